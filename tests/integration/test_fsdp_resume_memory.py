"""An FSDP2 resume on 2 gloo ranks (CPU, real processes) reads each rank's shards of the
checkpoint, never the whole state, and continues exactly where the run it resumes left off.

The model (41M parameters, 164 MB in fp32) is big enough that its full state (weights plus the
two AdamW moments, about 490 MB) dominates what a rank holds. Memory is measured inside each
rank as its private (anonymous) resident memory, sampled every millisecond while it loads: the
CPU counterpart of device memory, where the shards live. Pages of the checkpoint files that the
safetensors reader maps are page cache, shared between the ranks and reclaimable, and not
counted. The old full load (``load_checkpoint``, then shard, then the full optimizer state into
the sharded optimizer) measured the same way holds most of the full state, even on CPU where
the files it loads are mapped lazily; on a GPU it copies all of it to the device.

Exactness: the resumed ranks take the same step on the same batch, with the same 2-rank
reductions, as the ranks that wrote the checkpoint and kept going; the checkpoint holds fp32
weights and moments, so the two runs' weights after that step are bit-for-bit equal.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint  # noqa: F401  (loaded before any baseline: code, not state)
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from common.config import SpecRLConfig
from common.config.learner import LearnerConfig
from common.model import save_pretrained
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.batch import collate
from learner.checkpoint import (
    OPTIMIZER_FILE,
    TRAINING_DIR,
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from learner.distributed import full_model_state, load_optimizer_state, shard
from learner.optim import make_optimizer
from learner.wiring import gather_checkpoint, setup, train_on
from testing.fsdp import group_rank, spawn_ranks
from testing.groups import make_groups
from testing.models import random_model
from testing.shapes import shape

pytestmark = pytest.mark.integration

TOKENIZER = CharTokenizer(BUILTIN_ALPHABET)
VOCAB = TOKENIZER.vocab_size
CPU = torch.device("cpu")
SHAPE = shape(VOCAB, 512, 1536, 12, 8, 8)


def _config(model_dir: Path) -> SpecRLConfig:
    cfg = SpecRLConfig()
    cfg.model = dataclasses.replace(cfg.model, path=str(model_dir))
    cfg.learner = LearnerConfig(
        lr=1e-3, grad_clip=1.0, max_tokens_per_microbatch=32, logprob_chunk_tokens=8
    )
    return cfg


def _batches():
    return [
        collate(make_groups(VOCAB, n=2, g=4), 0, TOKENIZER.pad_id, CPU),
        collate(make_groups(VOCAB, n=2, g=4, version=1)[::-1], 1, TOKENIZER.pad_id, CPU),
    ]


def _anon() -> int:
    """Private (anonymous) bytes resident now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class AnonPeak:
    """Within: the highest private resident memory above the start, sampled every millisecond
    (what a rank holds stays held, so sampling sees it)."""

    def __enter__(self) -> AnonPeak:
        self.base = self.peak = _anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _anon())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _anon())

    @property
    def added(self) -> int:
        return self.peak - self.base


def _rank(rank: int, world: int, port: int, tmp: str, phase: str) -> None:
    with group_rank(rank, world, port) as ctx:
        out = Path(tmp)
        cfg = _config(out / "model")
        root = out / "checkpoints"
        batches = _batches()
        report: dict[str, float] = {}
        if phase == "train":
            # The run that is not interrupted: step 1, checkpoint, step 2.
            state = setup(cfg, root, CPU, ctx)
            train_on(state, batches[0], cfg)
            full = gather_checkpoint(state, ctx)
            if ctx.is_main:
                save_checkpoint(root, full, TOKENIZER, None, TrainerState(step=1, version=1))
            ctx.barrier()
            report["loss"] = train_on(state, batches[1], cfg)["learner/loss"]
            params = full_model_state(state.trainer.model)
        elif phase == "resume":
            with AnonPeak() as memory:
                state = setup(cfg, root, CPU, ctx)
            report["added"] = memory.added
            report["step"] = state.step
            report["sharded"] = _sharded(state.trainer.model, state.trainer.optimizer)
            report["loss"] = train_on(state, batches[1], cfg)["learner/loss"]
            params = full_model_state(state.trainer.model)
        else:  # "full_load": the resume before the sharded read
            with AnonPeak() as memory:
                policy, tensors, _, groups = load_checkpoint(latest_checkpoint(root), CPU)
                module = shard(policy)
                optimizer = make_optimizer(module, cfg.learner)
                load_optimizer_state(module, optimizer, tensors, groups)
            report["added"] = memory.added
            params = {}
        if ctx.is_main and params:
            save_file(params, str(out / f"{phase}.safetensors"))
        (out / f"{phase}_{rank}.json").write_text(json.dumps(report))
        # Tear the group down together (a rank leaving early can abort gloo's threads).
        ctx.barrier()


def _sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Every parameter and AdamW moment is a DTensor holding at most half the rows."""
    tensors = list(model.parameters()) + [
        v for state in optimizer.state.values() for v in state.values() if v.dim() > 0
    ]
    return all(
        isinstance(t, DTensor) and t.to_local().shape[0] <= -(-t.shape[0] // 2) for t in tensors
    )


def _run(tmp_path: Path, phase: str, world: int = 2) -> list[dict[str, float]]:
    spawn_ranks(_rank, str(tmp_path), phase, world=world)
    return [json.loads((tmp_path / f"{phase}_{r}.json").read_text()) for r in range(world)]


def test_two_rank_resume_reads_shards_and_continues_exactly(tmp_path):
    model_dir = tmp_path / "model"
    save_pretrained(random_model(seed=0, **SHAPE).train(), model_dir)
    TOKENIZER.save(model_dir)

    trained = _run(tmp_path, "train")
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    assert ckpt is not None
    full_state = (ckpt / "model.safetensors").stat().st_size + (
        ckpt / TRAINING_DIR / OPTIMIZER_FILE
    ).stat().st_size
    assert full_state > 450e6  # weights + two moments of 41M fp32 parameters

    resumed = _run(tmp_path, "resume")
    old = _run(tmp_path, "full_load")
    added = [r["added"] for r in resumed]
    held = [r["added"] for r in old]
    mb = lambda xs: [round(x / 1e6) for x in xs]  # noqa: E731
    print(
        f"full state {full_state / 1e6:.0f} MB; private memory added per rank: sharded resume "
        f"{mb(added)} MB, full load {mb(held)} MB"
    )
    # Each rank holds its half of the weights and moments, plus the reader's small buffers.
    assert all(r["sharded"] for r in resumed)
    assert max(added) < 0.7 * full_state, (added, full_state)
    # The same measurement sees the full load hold most of the state (a control of the bound).
    assert min(held) > 0.75 * full_state, (held, full_state)

    assert [r["step"] for r in resumed] == [1, 1]
    assert resumed[0]["loss"] == trained[0]["loss"]
    expected = load_file(str(tmp_path / "train.safetensors"))
    got = load_file(str(tmp_path / "resume.safetensors"))
    at_checkpoint = load_file(str(ckpt / "model.safetensors"))
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    # The step moved the weights: the comparison above is not between two copies of the input.
    assert any(not torch.equal(expected[n], at_checkpoint[n]) for n in at_checkpoint)

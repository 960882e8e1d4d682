"""FSDP2 data parallelism on 2 gloo ranks (CPU): the update equals the single-process one, and a
checkpoint gathered from 2 ranks resumes on 2 ranks exactly.

Tolerance: the ranks compute the same sums as one process, only split in two and added in a
different order (fp32 reduce-scatter), so parameters after an SGD step (lr 1: minus the gradient)
agree to rounding, ~1e-7 here; 1e-5 leaves room and is still far below any normalisation error
(a wrong world-size factor or a per-rank token mean moves them by >1e-3, see the negative control
in test_microbatch.py). AdamW steps divide by sqrt(v): for near-zero gradients that amplifies
rounding, so the AdamW comparison uses 1e-4.
"""

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.batch import collate
from learner.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from learner.distributed import full_model_state, load_optimizer_state, shard
from learner.optim import make_optimizer
from learner.step import Trainer
from learner.wiring import LearnerState, gather_checkpoint
from testing.fsdp import group_rank, spawn_ranks
from testing.groups import make_groups
from testing.models import tiny_model

TOKENIZER = CharTokenizer(BUILTIN_ALPHABET)
VOCAB = TOKENIZER.vocab_size
CPU = torch.device("cpu")
CFG = dict(grad_clip=0.0, max_tokens_per_microbatch=24, logprob_chunk_tokens=4)


def _batches():
    return [
        collate(make_groups(VOCAB, n=3, g=4), 0, 0, CPU),
        collate(make_groups(VOCAB, n=3, g=4, version=1)[::-1], 1, 0, CPU),
    ]


def _worker(rank: int, world: int, port: int, out: str, mode: str) -> None:
    with group_rank(rank, world, port) as ctx:
        cfg = LearnerConfig(**CFG)
        batches = _batches()
        module = shard(tiny_model(VOCAB))
        if mode == "sgd":
            optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
            metrics = Trainer(module, optimizer, cfg, SamplingConfig(), dist=ctx).step(batches[0])
            state = full_model_state(module)
            if rank == 0:
                save_file(state, os.path.join(out, "params.safetensors"))
                Path(out, "metrics.json").write_text(json.dumps(metrics))
            # Tear the group down together: a rank that destroys it while its peer still works
            # can abort in gloo's threads ("terminate called without an active exception").
            ctx.barrier()
            return
        # mode "resume": one AdamW step, checkpoint gathered to rank 0, fresh ranks resume from
        # it and take a second step.
        cfg = LearnerConfig(lr=1e-2, **CFG)
        optimizer = make_optimizer(module, cfg)
        trainer = Trainer(module, optimizer, cfg, SamplingConfig(), dist=ctx)
        trainer.step(batches[0])
        state = LearnerState(trainer, TOKENIZER, 1, 1, {}, [])
        full = gather_checkpoint(state, ctx)
        root = Path(out) / "ckpt"
        if rank == 0:
            save_checkpoint(root, full, TOKENIZER, None, TrainerState(1, 1))
        ctx.barrier()
        path = sorted(root.glob("step_*"))[-1]
        policy, tensors, trainer, groups = load_checkpoint(path, CPU)
        resumed = shard(policy)
        opt2 = make_optimizer(resumed, cfg)
        load_optimizer_state(resumed, opt2, tensors, groups)
        Trainer(resumed, opt2, cfg, SamplingConfig(), dist=ctx).step(batches[1])
        final = full_model_state(resumed)
        if rank == 0:
            save_file(final, os.path.join(out, "params.safetensors"))
            Path(out, "metrics.json").write_text(json.dumps(trainer.step))
        ctx.barrier()


def run_ranks(tmp_path, mode: str, world: int = 2) -> dict[str, torch.Tensor]:
    spawn_ranks(_worker, str(tmp_path), mode, world=world)
    return load_file(str(tmp_path / "params.safetensors"))


def test_two_rank_step_equals_the_single_process_step(tmp_path):
    model = tiny_model(VOCAB)
    single = copy.deepcopy(model)
    optimizer = torch.optim.SGD(single.parameters(), lr=1.0)
    metrics = Trainer(single, optimizer, LearnerConfig(**CFG), SamplingConfig()).step(_batches()[0])
    sharded = run_ranks(tmp_path, "sgd")
    expected = single.state_dict()
    assert set(sharded) == set(expected)
    diff = max(float((sharded[n] - expected[n]).abs().max()) for n in expected)
    moved = min(float((expected[n] - model.state_dict()[n]).abs().max()) for n in expected)
    assert diff < 1e-5 < moved, (diff, moved)
    ranks = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("learner/loss", "learner/clip_frac", "learner/grad_norm"):
        assert ranks[key] == pytest.approx(metrics[key], abs=1e-6), key


def test_two_rank_checkpoint_resumes_on_two_ranks(tmp_path):
    cfg = LearnerConfig(lr=1e-2, **CFG)
    single = tiny_model(VOCAB)
    optimizer = make_optimizer(single, cfg)
    for batch in _batches():
        Trainer(single, optimizer, cfg, SamplingConfig()).step(batch)
    resumed = run_ranks(tmp_path, "resume")
    assert json.loads((tmp_path / "metrics.json").read_text()) == 1
    expected = single.state_dict()
    diff = max(float((resumed[n] - expected[n]).abs().max()) for n in expected)
    assert diff < 1e-4, diff

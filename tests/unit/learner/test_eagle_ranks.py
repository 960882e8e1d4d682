"""The EAGLE-3 head with a 2-rank learner (FSDP2 on gloo, CPU): it is trained and published as on
one process (the root unit shards it with the embedding and LM head; its gradient accumulates
over learner steps there too), its optimizer state and schedule survive a checkpoint round trip
of the sharded optimizer, and an actor's torch engine drafts with the published head."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from common import metric_names as mn
from common.config.actor import SpecConfig
from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.eagle import EAGLE_PREFIX, attach_eagle
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.batch import collate
from learner.distributed import (
    full_optimizer_state,
    load_optimizer_state,
    shard,
    stream_full_state,
)
from learner.optim import eagle_group, make_optimizer
from learner.step import Trainer, draft_acceptance_key
from learner.wiring import attach_eagle_head
from testing.fsdp import group_rank, spawn_ranks
from testing.groups import make_groups
from testing.models import tiny_model

VOCAB = CharTokenizer(BUILTIN_ALPHABET).vocab_size
CPU = torch.device("cpu")
SPEC = SpecConfig(method="eagle3", k=3, eagle_lr=3e-3, eagle_accumulate=2, eagle_lr_warmup_steps=2)
CFG = LearnerConfig(lr=1e-3, max_tokens_per_microbatch=24, logprob_chunk_tokens=4)
STEPS = 4


def _policy() -> torch.nn.Module:
    model = tiny_model(VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    attach_eagle(model, vocab_ids=torch.arange(0, VOCAB, 2))
    return model


def _batch():
    return collate(make_groups(VOCAB, n=3, g=4), 0, 0, CPU)


def _train(model, optimizer, dist=None) -> list[dict[str, float]]:
    return [
        Trainer(model, optimizer, CFG, SamplingConfig(), spec=SPEC, dist=dist).step(_batch())
        for _ in range(STEPS)
    ]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    with group_rank(rank, world, port) as ctx:
        policy = _policy()
        attach_eagle_head(policy, SPEC, ctx)  # kept: no refusal with ranks any more
        module = shard(policy, "fp32")
        optimizer = make_optimizer(module, CFG, SPEC)
        metrics = _train(module, optimizer, ctx)
        into: dict[str, torch.Tensor] | None = {} if ctx.is_main else None
        state = stream_full_state(module, torch.float32, into)  # what a version publishes
        tensors, groups = full_optimizer_state(module, optimizer)
        if ctx.is_main:  # a checkpoint on a shared disk
            save_file(tensors, os.path.join(out, "optimizer.safetensors"))
            Path(out, "groups.json").write_text(json.dumps(groups))
        ctx.barrier()
        # A resume: a fresh sharded policy and optimizer fed the checkpoint's optimizer state.
        fresh = shard(_policy(), "fp32")
        fresh_opt = make_optimizer(fresh, CFG, SPEC)
        full = load_file(os.path.join(out, "optimizer.safetensors"))
        groups = json.loads(Path(out, "groups.json").read_text())
        load_optimizer_state(fresh, fresh_opt, full, groups)
        resumed = {k: v for k, v in eagle_group(fresh_opt).items() if k != "params"}
        if ctx.is_main:
            save_file(state, os.path.join(out, "published.safetensors"))
            Path(out, "report.json").write_text(
                json.dumps({"metrics": metrics, "resumed_group": resumed})
            )
        ctx.barrier()


def test_two_ranks_train_and_publish_the_head_as_one_process_and_an_actor_drafts_with_it(
    tmp_path,
):
    spawn_ranks(_worker, str(tmp_path))
    published = load_file(str(tmp_path / "published.safetensors"))
    report = json.loads((tmp_path / "report.json").read_text())

    start = _policy()
    single = copy.deepcopy(start)
    reference = _train(single, make_optimizer(single, CFG, SPEC))
    heads = [n for n in start.state_dict() if n.startswith(EAGLE_PREFIX)]
    assert heads and all(n in published for n in heads)
    moved = 0.0
    for name in heads:
        torch.testing.assert_close(published[name], single.state_dict()[name], rtol=1e-4, atol=1e-5)
        moved = max(moved, float((published[name] - start.state_dict()[name]).abs().max()))
    assert moved > 1e-3  # trained: two updates of accumulated gradients
    for ranks, one in zip(report["metrics"], reference, strict=True):
        for key in (mn.SPEC_DRAFT_ACCEPTANCE, draft_acceptance_key(3), mn.SPEC_EAGLE_KL):
            assert abs(ranks[key] - one[key]) < 1e-5, key
    # The sharded optimizer state's round trip keeps the head's group: its schedule and count.
    group = report["resumed_group"]
    assert group["eagle_head"] and group["eagle_updates"] == STEPS // SPEC.eagle_accumulate
    assert group["lr"] == SPEC.eagle_lr

    # An actor's torch engine loads the published version and drafts with its head.
    from actors.engines.torch.engine import TorchEngine

    actor = _policy().eval()
    actor.load_state_dict(published)
    spec = SpecConfig(method="eagle3", k=3, adaptive=False)
    engine = TorchEngine(actor, CharTokenizer(BUILTIN_ALPHABET).eos_id, 0, 1.0, seed=0, spec=spec)
    engine.generate([[1, 5, 6, 7], [1, 8]], 4, 12)
    stats = engine.stats()
    assert stats[mn.SPEC_ACCEPTANCE_RATE] > 0.0
    assert stats[mn.ACTOR_FORWARD_PASSES] < stats[mn.ACTOR_TOKENS]

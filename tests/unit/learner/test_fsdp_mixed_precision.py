"""FSDP2 mixed precision on 2 gloo ranks (CPU): under ``learner.precision=bf16-mixed`` the
parameters are all-gathered and used in bf16 and gradients reduce-scattered in fp32 into fp32
shards; under ``fp32`` everything stays fp32.

The collectives' dtypes are read from the tensors FSDP hands to ``torch.distributed``'s
all-gather and reduce-scatter (wrapped in the worker), the compute dtype from the weights a layer
and the embedding see inside their forward.

Agreement with one process: the 2-rank bf16-mixed update (SGD, lr 1: minus the gradient) is
compared with the single-process bf16-mixed one (fp32 weights under autocast). They differ by
bf16 rounding (FSDP also hands the elementwise ops and the residual stream bf16), not by a
wrong scale: the difference stays below 5% of the largest update (about 1% here); a factor-2
error would be 50%.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.batch import collate
from learner.distributed import (
    full_model_state,
    mixed_precision,
    shard,
)
from learner.step import Trainer
from testing.fsdp import group_rank, spawn_ranks
from testing.groups import make_groups
from testing.models import tiny_model

VOCAB = CharTokenizer(BUILTIN_ALPHABET).vocab_size
CPU = torch.device("cpu")
PRECISIONS = ("fp32", "bf16-mixed")


def _cfg(precision: str) -> LearnerConfig:
    return LearnerConfig(
        precision=precision, grad_clip=0.0, max_tokens_per_microbatch=24, logprob_chunk_tokens=4
    )


def _batch():
    return collate(make_groups(VOCAB, n=3, g=4), 0, 0, CPU)


def _record(seen: dict[str, set[str]], key: str, fn):
    """``fn`` (a collective: output, input, ...) noting its input's dtype under ``key``."""

    def wrapped(*args, **kwargs):
        tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
        seen.setdefault(key, set()).add(str(tensor.dtype))
        return fn(*args, **kwargs)

    return wrapped


def _sharded_step(precision: str, ctx, seen: dict[str, set[str]]) -> dict[str, torch.Tensor]:
    """One SGD step of the sharded tiny model; the dtypes met on the way go into ``seen``."""
    module = shard(tiny_model(VOCAB), precision)
    policy = module.policy
    for key, layer in (
        ("layer_weight", policy.model.layers[0].self_attn.q_proj),
        ("embedding_weight", policy.model.embed_tokens),
    ):
        layer.register_forward_hook(
            lambda m, i, o, key=key: seen.setdefault(key, set()).add(str(m.weight.dtype))
        )
    params = list(module.parameters())
    optimizer = torch.optim.SGD(params, lr=1.0)
    step = optimizer.step

    def step_noting_grads(*args, **kwargs):
        seen["shard_grad"] = {str(p.grad.dtype) for p in params if p.grad is not None}
        return step(*args, **kwargs)

    optimizer.step = step_noting_grads
    Trainer(module, optimizer, _cfg(precision), SamplingConfig(), dist=ctx).step(_batch())
    seen["shard"] = {str(p.dtype) for p in params}
    seen["dtensor"] = {str(all(isinstance(p, DTensor) for p in params))}
    return full_model_state(module)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    with group_rank(rank, world, port) as ctx:
        seen: dict[str, set[str]] = {}
        dist.all_gather_single = _record(seen, "all_gather", dist.all_gather_single)
        dist.reduce_scatter_single = _record(seen, "reduce_scatter", dist.reduce_scatter_single)
        report = {}
        for precision in PRECISIONS:
            seen.clear()
            state = _sharded_step(precision, ctx, seen)
            report[precision] = {k: sorted(v) for k, v in seen.items()}
            if rank == 0:
                save_file(state, os.path.join(out, f"{precision}.safetensors"))
        if rank == 0:
            Path(out, "dtypes.json").write_text(json.dumps(report))
        ctx.barrier()


def test_policy_by_precision():
    mixed = mixed_precision("bf16-mixed")
    assert (mixed.param_dtype, mixed.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert not mixed.cast_forward_inputs  # the root's inputs include fp32 reference log-probs
    for precision in ("fp32", "bf16"):
        plain = mixed_precision(precision)
        assert plain.param_dtype is None and plain.reduce_dtype is None


def test_bf16_mixed_gathers_and_computes_in_bf16_and_reduces_in_fp32(tmp_path):
    spawn_ranks(_worker, str(tmp_path))
    seen = json.loads((tmp_path / "dtypes.json").read_text())
    fp32, bf16 = "torch.float32", "torch.bfloat16"
    assert seen["bf16-mixed"] == {
        "all_gather": [bf16],
        "reduce_scatter": [fp32],
        "layer_weight": [bf16],
        "embedding_weight": [bf16],
        "shard": [fp32],
        "shard_grad": [fp32],
        "dtensor": ["True"],
    }
    assert seen["fp32"] == {
        "all_gather": [fp32],
        "reduce_scatter": [fp32],
        "layer_weight": [fp32],
        "embedding_weight": [fp32],
        "shard": [fp32],
        "shard_grad": [fp32],
        "dtensor": ["True"],
    }

    # The 2-rank bf16-mixed update against the single-process one.
    start = tiny_model(VOCAB)
    single = copy.deepcopy(start)
    optimizer = torch.optim.SGD(single.parameters(), lr=1.0)
    Trainer(single, optimizer, _cfg("bf16-mixed"), SamplingConfig()).step(_batch())
    ranks = load_file(str(tmp_path / "bf16-mixed.safetensors"))
    before, after = start.state_dict(), single.state_dict()
    update = {n: after[n] - before[n] for n in before}
    diff = max(float((ranks[n] - after[n]).abs().max()) for n in before)
    scale = max(float(u.abs().max()) for u in update.values())
    assert 0 < diff < 0.05 * scale, (diff, scale)

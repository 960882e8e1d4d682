"""The node check's FSDP2 stage (benchmarks/gpu_check/node.py): one learner step on 2 ranks
(``torchrun``; NCCL on GPUs, gloo with ``--cpu``) and the streamed full-state gather
(``learner.distributed.stream_full_state``), against the same step on one process.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m benchmarks.gpu_check.node_fsdp --out DIR --shape JSON

Rank 0 writes the gathered fp32 state (``fsdp.safetensors``) and its timings (``fsdp.json``) to
``DIR``; :func:`compare` takes the single-process step in the caller and compares."""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import cli
from common import metric_names as mn
from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from learner.batch import collate
from learner.step import Trainer
from testing.groups import make_groups

STEP_CFG = dict(grad_clip=0.0, max_tokens_per_microbatch=24, logprob_chunk_tokens=4)
"""SGD at lr 1 (the parameters move by minus the gradient): rounding is all that separates 2
ranks from one process, ~1e-7 in fp32 (tests/unit/learner/test_fsdp.py's reasoning)."""
GROUPS, GROUP_SIZE = 4, 4


def build(shape: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """The same random model (seed 0) on every rank and in the reference, in train mode."""
    return cli.random_model(device=device, **shape).train()


def step(model: torch.nn.Module, shape: dict[str, Any], device: torch.device, dist=None):
    """One SGD step (lr 1) on fixed groups; the step's metrics."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    batch = collate(make_groups(shape["vocab_size"], GROUPS, GROUP_SIZE), 0, 0, device)
    return Trainer(model, optimizer, LearnerConfig(**STEP_CFG), SamplingConfig(), dist=dist).step(
        batch
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank_main(out: Path, shape: dict[str, Any]) -> None:
    """One rank: shard, step, stream the full state to rank 0 (which writes it)."""
    from safetensors.torch import save_file

    from learner.distributed import init_from_env, shard, shutdown, stream_full_state

    torch.set_num_threads(1)
    ctx = init_from_env(timeout_s=120)
    if ctx is None:
        raise SystemExit("node_fsdp: run under torchrun with 2 ranks")
    try:
        module = shard(build(shape, ctx.device))
        started = time.perf_counter()
        metrics = step(module, shape, ctx.device, ctx)
        _sync(ctx.device)
        step_s = time.perf_counter() - started
        into: dict[str, torch.Tensor] | None = {} if ctx.is_main else None
        started = time.perf_counter()
        stream_full_state(module, torch.float32, into)
        gather_s = time.perf_counter() - started
        if into is not None:
            save_file({k: v.contiguous() for k, v in into.items()}, str(out / "fsdp.safetensors"))
            nbytes = sum(v.numel() * v.element_size() for v in into.values())
            info = {
                "world": ctx.world,
                "backend": "nccl" if ctx.device.type == "cuda" else "gloo",
                "step_s": round(step_s, 4),
                "gather_s": round(gather_s, 4),
                "gather_bytes": nbytes,
                "loss": metrics[mn.LEARNER_LOSS],
                "grad_norm": metrics[mn.LEARNER_GRAD_NORM],
            }
            (out / "fsdp.json").write_text(json.dumps(info))  # scratch: rank 0's, for node.py
        ctx.barrier()
    finally:
        shutdown()


def compare(out: Path, shape: dict[str, Any], device: torch.device, tol: float) -> dict[str, Any]:
    """The ranks' gathered state against the single-process step on ``device``."""
    from safetensors.torch import load_file

    info = json.loads((out / "fsdp.json").read_text())
    gathered = load_file(str(out / "fsdp.safetensors"))
    initial = build(shape, device)
    single = copy.deepcopy(initial)
    metrics = step(single, shape, device)
    expected = {k: v.detach().float().cpu() for k, v in single.state_dict().items()}
    before = {k: v.detach().float().cpu() for k, v in initial.state_dict().items()}
    missing = sorted(set(expected) ^ set(gathered))
    diff = max((float((gathered[n] - expected[n]).abs().max()) for n in expected), default=0.0)
    moved = min(float((expected[n] - before[n]).abs().max()) for n in expected)
    loss_diff = abs(info["loss"] - metrics[mn.LEARNER_LOSS])
    passed = not missing and diff < tol and moved > 10 * diff and loss_diff < 1e-4
    return info | {
        "passed": passed,
        "tensors": len(gathered),
        "names_differing": missing,
        "max_abs_diff": diff,
        "tolerance": tol,
        "min_param_move": moved,
        "loss_abs_diff": loss_diff,
        "gather_gbps": round(info["gather_bytes"] / max(info["gather_s"], 1e-9) / 1e9, 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", required=True, help="the model's ModelArgs fields (JSON)")
    opts = p.parse_args()
    rank_main(opts.out, json.loads(opts.shape))


if __name__ == "__main__":
    main()

"""The stages of one published version, each timed on this machine, and the per-version time
they project for Qwen2.5-7B on a 4-GPU learner (``python -m benchmarks.weights``, or alone with
``--stages-only``).

What the code does for one version (learner/versions.py, common/weights/publish/): the learner's
``PolicyView.refresh`` streams the state to rank 0 in the publish dtype (each rank casts its
shard, then one ``DTensor.full_tensor()`` per tensor, copied into rank 0's buffer), the only
part the training ranks wait for; the publisher copies that buffer into a shared-memory slot
(during the next step); the upload process checks it is finite, hashes it (the full-weights
digest, ``threads`` threads), serialises it (safetensors bytes, ``threads`` threads) and writes
the chunks to Redis while ``threads`` threads hash them. The stages run one after another on the
whole state, not pipelined per tensor, so a version takes the sum of the stage times:

    t = M / (G * R_cast) + sum over the other stages s of  M / R_s

with M the published bytes (bf16), G the learner's GPUs (each casts its own shard, at once) and
R_s each stage's rate in bytes of bf16 state per second.
Every rate is measured here on the CPU, the gather included (2 gloo ranks on loopback): a
projection from this machine's rates, not a GPU measurement. On GPUs the cast runs on each
device and the gather over NCCL/NVLink, far faster than gloo on loopback.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import redis
import torch
from torch import nn

from common.weights.format import (
    check_finite,
    publish_threads,
    serialize_state_dict,
    weights_digest,
)
from common.weights.publish.upload import new_slot, slot_layout, slot_views
from common.weights.publish.writer import write_chunks
from learner.distributed import stream_full_state
from testing.fsdp import group_rank, spawn_ranks

GB = 10**9
QWEN_7B_PARAMS = 7.62e9
QWEN_7B_BF16_BYTES = 15.2e9  # M: the published bytes of a version
LEARNER_GPUS = 4
PUBLISH_GOAL_S = 5.0
STAGES = ("cast", "gather_stream", "copy_to_slot", "finite_check", "hash", "serialise", "write")
"""In the order a version goes through them. ``cast``: fp32 to bf16 on one core, every rank
its own shard (a quarter of the state on 4 GPUs, in parallel); ``gather_stream``: the learner's
refresh on 2 gloo ranks of a bf16-sharded state (no cast left to do), one ``full_tensor`` per
tensor copied into rank 0's buffer."""


def _state(total_bytes: int, tensors: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``tensors`` random tensors of ``total_bytes`` in all (in ``dtype``), rows of 4096."""
    rows = max(1, total_bytes // tensors // dtype.itemsize // 4096)
    generator = torch.Generator().manual_seed(0)
    return {
        f"layer.{i}.weight": torch.randn(rows, 4096, generator=generator).to(dtype)
        for i in range(tensors)
    }


def _best(fn: Callable[[], object], repeats: int) -> float:
    """The median seconds of ``repeats`` calls of ``fn`` (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _gather_worker(rank: int, world: int, port: int, total_bytes: int, out) -> None:
    """One rank of the measured refresh: bf16 parameters sharded with FSDP2, streamed."""
    from torch.distributed.fsdp import fully_shard

    with group_rank(rank, world, port) as ctx:
        module = nn.Module()
        for name, t in _state(total_bytes, 8, torch.bfloat16).items():
            module.register_parameter(name.replace(".", "_"), nn.Parameter(t))
        fully_shard(module)
        into: dict[str, torch.Tensor] | None = {} if ctx.is_main else None

        def refresh() -> None:
            stream_full_state(module, torch.bfloat16, into)
            ctx.barrier()

        seconds = _best(refresh, 3)
        if ctx.is_main:
            out.put(seconds)
        ctx.barrier()


def gather_seconds(total_bytes: int) -> float:
    """Seconds of a 2-rank gloo refresh of a state of ``total_bytes`` in bf16 (median of 3)."""
    import torch.multiprocessing as mp

    out = mp.get_context("spawn").SimpleQueue()
    spawn_ranks(_gather_worker, total_bytes, out)
    return out.get()


def stage_seconds(client: redis.Redis, total_bytes: int, threads: int) -> dict[str, float]:
    """Seconds of each stage but the gather for a bf16 state of ``total_bytes`` (8 tensors)."""
    fp32 = _state(total_bytes * 2, 8, torch.float32)
    bf16 = {name: t.to(torch.bfloat16) for name, t in fp32.items()}
    layout, slot_bytes = slot_layout(bf16, torch.bfloat16)
    views = slot_views(new_slot(layout, slot_bytes).share_memory_(), layout)
    data = serialize_state_dict(bf16, threads)

    def copy_to_slot() -> None:
        for name, t in bf16.items():
            views[name].copy_(t)

    def write() -> None:
        keys, _ = write_chunks(client, "stages", 1, data, 8 * 2**20, 600, threads)
        client.delete(*keys)

    seconds = {
        "cast": _best(lambda: [t.to(torch.bfloat16) for t in fp32.values()], 3),
        "copy_to_slot": _best(copy_to_slot, 3),
        "finite_check": _best(lambda: check_finite(0, bf16), 3),
        "hash": _best(lambda: weights_digest(bf16, threads=threads), 3),
        "hash_1_thread": _best(lambda: weights_digest(bf16, threads=1), 3),
        "serialise": _best(lambda: serialize_state_dict(bf16, threads), 3),
        "write": _best(write, 3),
    }
    return seconds


def stage_figures(url: str, total_mb: int = 256) -> dict[str, object]:
    """Each stage's GB/s here (bytes of bf16 state per second) and the projected seconds per
    version of Qwen2.5-7B on a 4-GPU learner: M / rate summed over the stages."""
    threads = publish_threads()
    total_bytes = total_mb * 10**6
    client = redis.Redis.from_url(url)
    try:
        seconds = stage_seconds(client, total_bytes, threads)
    finally:
        client.close()
    seconds["gather_stream"] = gather_seconds(total_bytes)  # the host's tensors freed first
    measured = sum(t.numel() * 2 for t in _state(total_bytes, 8, torch.bfloat16).values())
    gbps = {stage: round(measured / s / GB, 3) for stage, s in seconds.items()}
    # Each rank casts its own shard: on LEARNER_GPUS ranks, a quarter of the state each, at once.
    share = {s: 1 / LEARNER_GPUS if s == "cast" else 1.0 for s in STAGES}
    per_stage_s = {s: round(share[s] * QWEN_7B_BF16_BYTES / (gbps[s] * GB), 2) for s in STAGES}
    projected = round(sum(per_stage_s.values()), 2)
    return {
        "publish_stage_gbps": gbps,
        "publish_stage_bytes": measured,
        "publish_7b_projected_stage_s": per_stage_s,
        "publish_7b_projected_s": projected,
        "publish_7b_projected_learner_waits_s": per_stage_s["gather_stream"],
        "publish_7b_projected_threads": threads,
        "publish_7b_projected_goal_s": PUBLISH_GOAL_S,
        "publish_7b_projected_met": projected <= PUBLISH_GOAL_S,
        "publish_7b_model": {
            "params": QWEN_7B_PARAMS,
            "bf16_bytes": QWEN_7B_BF16_BYTES,
            "learner_gpus": LEARNER_GPUS,
        },
    }

"""The node-local path of a published version (docs/design.md §6.5), stage by stage, each timed
on this machine per core, and the seconds per version they project for Qwen2.5-7B beside the
Redis path's projection (benchmarks/publish_stages.py; run by ``python -m benchmarks.weights``).

With the node-local plane, the upload process of a learner whose node has actors takes a
version from its shared-memory slot, checks it is finite, hashes it (the full-weights digest)
and writes it as a safetensors file into the node's weights cache (``/dev/shm``), renamed into
place; then it commits the manifest in Redis, and the actors of the node read the file. The
Redis bytes (for other nodes) follow the commit and are not on this path. Each of the three
passes runs on ``threads`` threads (common/weights/format.py ``check_finite``,
``weights_digest``; common/weights/host_cache.py ``HostCache.put_tensors``), so each is
timed here on one thread, its per-core rate R_s taken as bytes per CPU-second of that thread
(this 2-core machine is shared: other processes take wall time from a stage, not CPU time;
the wall-clock rates are reported beside), and projected on ``c`` cores:

    t = M / R_copy + M / (c * R_finite) + max(M / (c * R_hash), L / R_hash) + M / (c * R_write)

with M the version's bytes (bf16), L its largest tensor (the digest hashes each tensor on one
thread: Qwen2.5-7B's embedding and LM head are 152064 x 3584 bf16, 1.09 GB each), R_copy the
copy into the slot (one thread), and c = ``CORES`` (at most 16; the upload process
uses up to 16 threads, ``common.weights.format.MAX_PUBLISH_THREADS``). Linear in c is an
assumption: these passes read or write memory at a few GB/s per core, far under a server
socket's memory bandwidth at 16 cores, but this 2-core machine cannot show it. Not counted: the
learner's gather to rank 0 and the cast (GPU work, the same for both paths; the CPU gloo figure
is ``publish_7b_projected_learner_waits_s``) and the commit (one Redis round trip).

The actors' side, for reference (``deliver_7b_projected_actor_s``): a local actor copies the
file into its own memory (``HostCache.get``, ``preadv`` on up to 16 threads) and hashes its copy
(the digest on up to 4 threads), ``M / (c * R_read) + max(M / (4 * R_hash), L / R_hash)``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from benchmarks.publish_stages import GB, PUBLISH_GOAL_S, QWEN_7B_BF16_BYTES
from common.weights.format import check_finite, publish_threads, weights_digest
from common.weights.host_cache import HostCache
from common.weights.publish.upload import new_slot, slot_layout, slot_views

CORES = 16
"""Cores the projection assumes for the multi-threaded stages (the upload process's most)."""
ACTOR_HASH_THREADS = 4
"""Threads an actor hashes its copy on (``weights_digest``'s default, at most 4)."""
QWEN_7B_LARGEST_TENSOR_BYTES = 152064 * 3584 * 2
"""L: Qwen2.5-7B's embedding (and its untied LM head) in bf16."""


def _state(total_bytes: int, tensors: int) -> dict[str, torch.Tensor]:
    rows = max(1, total_bytes // tensors // 2 // 4096)
    generator = torch.Generator().manual_seed(0)
    return {
        f"layer.{i}.weight": torch.randn(rows, 4096, generator=generator).to(torch.bfloat16)
        for i in range(tensors)
    }


def _median(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds of this thread over ``repeats`` calls of
    ``fn`` (after a warm-up call)."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        started, cpu_started = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - cpu_started)
        wall.append(time.perf_counter() - started)
    return statistics.median(wall), statistics.median(cpu)


def node_stage_seconds(
    total_bytes: int, root: str, repeats: int = 3
) -> dict[str, tuple[float, float]]:
    """(wall, CPU) seconds of each node-local stage on this thread alone, and (wall, 0) on
    this machine's threads for reference, for a bf16 state of ``total_bytes`` in 8 tensors,
    the cache under ``root``."""
    state = _state(total_bytes, 8)
    layout, slot_bytes = slot_layout(state, torch.bfloat16)
    views = slot_views(new_slot(layout, slot_bytes).share_memory_(), layout)
    cache = HostCache(root, keep=1)
    digest = weights_digest(state)
    threads = publish_threads()
    version = iter(range(1, 10**6))

    def copy_to_slot() -> None:
        for name, t in state.items():
            views[name].copy_(t)

    def write(n: int) -> None:
        assert cache.put_tensors("stages", next(version), digest, views, n)

    seconds = {
        "copy_to_slot": _median(copy_to_slot, repeats),
        "finite_check": _median(lambda: check_finite(0, views, 1), repeats),
        "hash": _median(lambda: weights_digest(views, threads=1), repeats),
        "shm_write": _median(lambda: write(1), repeats),
    }
    last = next(version) - 1

    def read(n: int) -> None:
        assert cache.get("stages", last, digest, n) is not None  # the newest file: kept

    seconds["shm_read"] = _median(lambda: read(1), repeats)
    for stage, fn in (  # the file write last: the one read above is pruned by it
        ("finite_check", lambda: check_finite(0, views, threads)),
        ("hash", lambda: weights_digest(views, threads=threads)),
        ("shm_read", lambda: read(threads)),
        ("shm_write", lambda: write(threads)),
    ):
        seconds[f"{stage}_{threads}_threads"] = (_median(fn, repeats)[0], 0.0)
    cache.remove_run("stages")
    return seconds


def node_figures(redis_stages: dict, total_mb: int = 256) -> dict[str, object]:
    """The node-local stages' GB/s here and the projected seconds per Qwen2.5-7B version on
    the node-local path, beside the Redis path's (``redis_stages``: ``stage_figures``)."""
    total_bytes = total_mb * 10**6
    with tempfile.TemporaryDirectory(prefix="specrl-node-stages-", dir=_shm_root()) as root:
        seconds = node_stage_seconds(total_bytes, root)
    measured = sum(t.numel() * 2 for t in _state(total_bytes, 8).values())
    wall_gbps = {stage: round(measured / w / GB, 3) for stage, (w, _) in seconds.items()}
    # Per core: bytes per CPU-second of the one thread that ran the stage (the other load on
    # this shared machine takes wall time from it, not CPU time).
    rate = {stage: measured / c / GB for stage, (_, c) in seconds.items() if c > 0}
    m, big = QWEN_7B_BF16_BYTES, QWEN_7B_LARGEST_TENSOR_BYTES
    stage_s = {
        "copy_to_slot": m / (rate["copy_to_slot"] * GB),
        "finite_check": m / (CORES * rate["finite_check"] * GB),
        "hash": max(m / (CORES * rate["hash"] * GB), big / (rate["hash"] * GB)),
        "shm_write": m / (CORES * rate["shm_write"] * GB),
    }
    projected = round(sum(stage_s.values()), 2)
    actor_s = m / (CORES * rate["shm_read"] * GB) + max(
        m / (ACTOR_HASH_THREADS * rate["hash"] * GB), big / (rate["hash"] * GB)
    )
    return {
        "publish_7b_projected_s": projected,
        "publish_7b_projected_s_redis": redis_stages["publish_7b_projected_s"],
        "publish_7b_projected_goal_s": PUBLISH_GOAL_S,
        "publish_7b_projected_met": projected <= PUBLISH_GOAL_S,
        "publish_7b_projected_formula": (
            "M/R_copy_to_slot + M/(c*R_finite_check) + max(M/(c*R_hash), L/R_hash) "
            "+ M/(c*R_shm_write); R_s: bytes per CPU-second of one thread running stage s "
            "here, M = 15.2e9 bytes (Qwen2.5-7B bf16), L = 152064*3584*2 bytes (its largest "
            f"tensor, hashed on one thread), c = {CORES} cores; not counted: the learner's "
            "gather and cast (GPU) and the commit (one Redis round trip)"
        ),
        "publish_7b_projected_cores": CORES,
        "publish_7b_projected_node_stage_s": {k: round(v, 2) for k, v in stage_s.items()},
        "publish_7b_projected_redis_formula": (
            "sum over cast/4, gather_stream, copy_to_slot, finite_check, hash, serialise, write "
            "of M/R_s, R_s wall-clock rates at this machine's threads "
            "(benchmarks/publish_stages.py; details under publish_stages_redis)"
        ),
        "node_stage_gbps_per_core": {k: round(v, 3) for k, v in rate.items()},
        "node_stage_gbps_wall": wall_gbps,
        "node_stage_bytes": measured,
        "deliver_7b_projected_actor_s": round(actor_s, 2),
        "deliver_7b_projected_actor_formula": (
            f"M/(c*R_shm_read) + max(M/({ACTOR_HASH_THREADS}*R_hash), L/R_hash), c = {CORES}: "
            "a local actor copies the file into its own memory and hashes its copy"
        ),
    }


def _shm_root() -> str | None:
    """``/dev/shm`` where it is a directory (the node cache's default), else the temp dir."""
    from pathlib import Path

    return "/dev/shm" if Path("/dev/shm").is_dir() else None

"""The node check's weight-plane stage (benchmarks/gpu_check/node.py): bytes per second of a
state broadcast from one process to another (NCCL between two GPUs, gloo with ``--cpu``), and
the kill test: the receiver killed mid-transfer while the sender runs under
``actors.engines.vllm.plugins.transfer_nccl.run_with_deadline`` (the NCCL sender's deadline and
kill), which must return with an error within its deadline.

    python -m benchmarks.gpu_check.node_plane bandwidth|sender|receiver --port P --mb M ...

Every process meets at 127.0.0.1:P: rank 0 sends, rank 1 receives. The state is ``M`` MiB of
float32 in chunks of at most 64 MiB, filled with a pattern the receiver checks exactly."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

CHUNK_MB = 64


def _join(rank: int, port: int, gpu: bool) -> torch.device:
    """Rank ``rank`` of a 2-process group at 127.0.0.1:``port``; its device."""
    if gpu:
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if gpu else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    return torch.device("cuda", rank) if gpu else torch.device("cpu")


def chunks(mb: float, device: torch.device, fill: bool) -> list[torch.Tensor]:
    """``mb`` MiB of float32 in chunks; ``fill``: chunk ``i`` holds ``i + arange`` (mod 2^20)."""
    total = int(mb * (1 << 20)) // 4
    per = CHUNK_MB * (1 << 20) // 4
    sizes = [min(per, total - start) for start in range(0, total, per)]
    if not fill:
        return [torch.empty(n, dtype=torch.float32, device=device) for n in sizes]
    return [_pattern(i, n, device) for i, n in enumerate(sizes)]


def _pattern(i: int, n: int, device: torch.device) -> torch.Tensor:
    return ((torch.arange(n, device=device) + i) % (1 << 20)).float()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_rank(rank: int, port: int, mb: float, rounds: int, gpu: bool, out: Path) -> None:
    """Both ranks: ``rounds`` timed broadcasts of the state after one warm-up; rank 1 checks
    every chunk and writes the figures."""
    device = _join(rank, port, gpu)
    try:
        state = chunks(mb, device, fill=rank == 0)
        times, exact = [], True
        for r in range(1 + rounds):
            dist.barrier()
            _sync(device)
            started = time.perf_counter()
            for t in state:
                dist.broadcast(t, src=0)
            _sync(device)
            times += [time.perf_counter() - started] if r else []
            if rank == 1:
                exact &= all(
                    torch.equal(t, _pattern(i, t.numel(), device)) for i, t in enumerate(state)
                )
        if rank == 1:
            nbytes = sum(t.numel() * 4 for t in state)
            seconds = statistics.median(times)
            figures = {
                "backend": dist.get_backend(),
                "bytes": nbytes,
                "rounds": rounds,
                "seconds_all": [round(t, 4) for t in times],
                "gbps": round(nbytes / seconds / 1e9, 4),
                "received_exact": exact,
            }
            out.write_text(json.dumps(figures))  # scratch, read back by node.py
        dist.barrier()
    finally:
        dist.destroy_process_group()


def send_forever(port: int, mb: float, gpu: bool) -> None:
    """The sender process of the kill test (rank 0): broadcasts the state until it fails."""
    device = _join(0, port, gpu)
    state = chunks(mb, device, fill=True)
    while True:
        for t in state:
            dist.broadcast(t, src=0)
        _sync(device)


def receive_forever(port: int, mb: float, gpu: bool, progress: Path) -> None:
    """The receiver process of the kill test (rank 1): writes ``progress`` once a chunk has
    arrived, then keeps receiving until it is killed."""
    device = _join(1, port, gpu)
    state = chunks(mb, device, fill=False)
    dist.broadcast(state[0], src=0)
    _sync(device)
    progress.write_text("receiving")
    while True:
        for t in state:
            dist.broadcast(t, src=0)


def kill_test(port: int, mb: float, gpu: bool, deadline_s: float, workdir: Path) -> dict[str, Any]:
    """A receiver process, a sender under ``run_with_deadline``; the receiver is SIGKILLed once
    data flows. Passed: the sender returned with an error no later than the deadline (plus 5 s
    for the kill and the join) and the receiver is gone."""
    from actors.engines.vllm.plugins.transfer_nccl import run_with_deadline

    progress = workdir / "receiver.progress"
    progress.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", __name__, "receiver", "--port", str(port), "--mb", str(mb)]
    cmd += ["--progress", str(progress)] + (["--gpu"] if gpu else [])
    receiver = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    result: dict[str, Any] = {}

    def send() -> None:
        started = time.perf_counter()
        try:
            run_with_deadline(send_forever, (port, mb, gpu), deadline_s)
            result["error"] = None
        except Exception as e:  # noqa: BLE001 - what the sender raised is the figure
            result["error"] = f"{type(e).__name__}: {e}"
        result["sender_return_s"] = time.perf_counter() - started

    started = time.perf_counter()
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    # Until data flows; or the sender returned, the receiver died, or the deadline passed.
    while (
        not progress.exists()
        and receiver.poll() is None
        and thread.is_alive()
        and time.perf_counter() - started < deadline_s
    ):
        time.sleep(0.05)
    flowing = progress.exists()
    killed_at = time.perf_counter() - started
    receiver.kill()
    receiver_code = receiver.wait(30)
    stderr = receiver.stderr.read().decode(errors="replace")[-2000:] if receiver.stderr else ""
    thread.join(deadline_s + 30)
    returned = not thread.is_alive()
    seconds = result.get("sender_return_s")
    in_time = seconds is not None and seconds <= deadline_s + 5
    figures = {
        "deadline_s": deadline_s,
        "data_flowed_before_kill": flowing,
        "receiver_killed_after_s": round(killed_at, 3),
        "receiver_exit_code": receiver_code,
        "sender_returned": returned,
        "sender_return_s": None if seconds is None else round(seconds, 3),
        "sender_error": result.get("error"),
        "passed": bool(flowing and returned and in_time and result.get("error")),
    }
    if not flowing:
        figures["receiver_stderr"] = stderr
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("role", choices=("bandwidth", "receiver"))
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mb", type=float, required=True)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, help="bandwidth: rank 1's figures (JSON)")
    p.add_argument("--progress", type=Path, help="receiver: written once data arrives")
    opts = p.parse_args()
    if opts.role == "receiver":
        receive_forever(opts.port, opts.mb, opts.gpu, opts.progress)
    else:
        import os

        rank = int(os.environ["RANK"])
        bandwidth_rank(rank, opts.port, opts.mb, opts.rounds, opts.gpu, opts.out)


if __name__ == "__main__":
    main()

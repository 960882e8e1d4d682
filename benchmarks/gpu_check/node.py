"""GPU node check: what a node of at least 2 GPUs with the vLLM image must show before a
multi-GPU run (``bash scripts/gpu-node-check.sh``), and its CPU mode (``--cpu``, run by
tests/integration/test_gpu_node_check.py). Stages, each recorded under its name in the JSON with
``passed`` (true, false, or null when ``skipped``), ``reason`` and its figures:

1. ``fsdp``: one learner step on 2 FSDP2 ranks (torchrun; NCCL, or gloo with ``--cpu``) and the
   streamed full-state gather to rank 0 (``learner.distributed.stream_full_state``), against the
   same step on one process (benchmarks/gpu_check/node_fsdp.py).
2. ``plane``: a state broadcast from one process to another (GB/s; NCCL between two GPUs, gloo
   with ``--cpu``), and ``plane_kill``: the receiver SIGKILLed mid-transfer, the sender under the
   NCCL sender's deadline (``actors.engines.vllm.plugins.transfer_nccl.run_with_deadline``)
   must return with an error within it (benchmarks/gpu_check/node_plane.py).
3. ``vllm_v1`` and ``vllm_v2_async``: version tags under swaps and prompt-log-prob scoring on
   ``VllmEngine`` (benchmarks/gpu_check/node_vllm.py), with the V1 model runner and with the V2
   runner under async scheduling; skipped where vLLM is not importable, ``vllm_v2_async`` also
   without CUDA.

    bash scripts/gpu-node-check.sh [--cpu] [--json PATH] [--plane-mb MB] [--deadline-s S]

The JSON goes to ``--json``, else ``$OUT/gpu_node.json``, else benchmarks/results/ (``_cpu``
with ``--cpu``); it is rewritten after every stage. Exit status 1 when a stage that ran failed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import cli
from benchmarks.gpu_check.plan import ROOT, Run
from testing.shapes import shape as llama_shape

CPU_SHAPE = llama_shape(97, 64, 128, 2, 2, 1)
GPU_SHAPE = llama_shape(32768, 1024, 2816, 8, 16, 4)
DEFAULTS = {"plane_mb": (1024.0, 32.0), "deadline_s": (60.0, 20.0)}  # (GPU, --cpu)
CHILD_TIMEOUT_S = 300


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_json(cpu: bool) -> Path:
    name = "gpu_node_cpu.json" if cpu else "gpu_node.json"
    out = os.environ.get("OUT")
    return Path(out) / name if out else ROOT / "benchmarks" / "results" / name


def child(cmd: list[str], env: dict[str, str] | None = None) -> None:
    """A child process of the check; its output's tail in the error when it fails."""
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    if proc.returncode != 0:
        tail = (proc.stdout[-2000:] + proc.stderr[-4000:]).strip()
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n{tail}")


def fsdp_stage(cpu: bool, work: Path) -> dict[str, Any]:
    from benchmarks.gpu_check.node_fsdp import compare

    shape = CPU_SHAPE if cpu else GPU_SHAPE
    out = work / "fsdp"
    out.mkdir()
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    child(
        [
            *run,
            "-m",
            "benchmarks.gpu_check.node_fsdp",
            "--out",
            str(out),
            "--shape",
            json.dumps(shape),
        ]
    )
    device = torch.device("cpu" if cpu else "cuda", 0)
    return compare(out, shape, device, 1e-5 if cpu else 1e-4) | {"shape": shape}


def plane_stage(cpu: bool, mb: float, work: Path) -> dict[str, Any]:
    out, port = work / "plane.json", free_port()
    cmd = [sys.executable, "-m", "benchmarks.gpu_check.node_plane", "bandwidth"]
    cmd += ["--port", str(port), "--mb", str(mb), "--out", str(out)] + ([] if cpu else ["--gpu"])
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "RANK": str(r)}, stderr=subprocess.PIPE)
        for r in (0, 1)
    ]
    try:
        codes = [p.wait(CHILD_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0, 0]:
        errors = [p.stderr.read().decode(errors="replace")[-3000:] for p in procs if p.stderr]
        raise RuntimeError(f"broadcast ranks exited {codes}: {errors}")
    figures = json.loads(out.read_text())
    transport = "torch.distributed broadcast (" + figures["backend"] + ")"
    return figures | {"transport": transport, "passed": figures["received_exact"]}


def kill_stage(cpu: bool, mb: float, deadline_s: float, work: Path) -> dict[str, Any]:
    from benchmarks.gpu_check.node_plane import kill_test

    return kill_test(free_port(), mb, not cpu, deadline_s, work)


def vllm_stage(runner: str, cpu: bool, work: Path) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        return skipped("vLLM is not importable here")
    if runner == "v2_async" and cpu:
        return skipped("needs CUDA")
    out = work / f"vllm_{runner}.json"
    child(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_check.node_vllm",
            "--runner",
            runner,
            "--out",
            str(out),
        ]
    )
    return json.loads(out.read_text())


def skipped(reason: str) -> dict[str, Any]:
    return {"passed": None, "skipped": True, "reason": f"skipped: {reason}"}


def stage(run: Run, name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """``fn``'s figures under ``name`` with ``passed``/``skipped``/``reason``; an exception is a
    failed stage (its error recorded by ``Run.stage``)."""

    def wrapped() -> dict[str, Any]:
        figures = fn()
        figures.setdefault("skipped", False)
        figures.setdefault("reason", None if figures["passed"] else "its checks failed")
        return {name: figures}

    if not run.stage(name, wrapped):
        run.figures[name] = {
            "passed": False,
            "skipped": False,
            "reason": run.errors[-1]["error"][:600],
        }
    run.say(name, json.dumps({k: v for k, v in run.figures[name].items() if k != "tags"}))


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--cpu", action="store_true", help="2 CPU processes, gloo, tiny sizes (CI)")
    p.add_argument("--plane-mb", type=float, help="MiB broadcast by the plane stage")
    p.add_argument("--deadline-s", type=float, help="the kill test's sender deadline")
    opts = p.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not opts.cpu and gpus < 2:
        p.error(
            f"this node check needs at least 2 GPUs, found {gpus}: run it on such a node, or with --cpu"
        )
    mode = 1 if opts.cpu else 0
    mb = opts.plane_mb or DEFAULTS["plane_mb"][mode]
    deadline_s = opts.deadline_s or DEFAULTS["deadline_s"][mode]
    if mb <= 0 or deadline_s <= 0:
        p.error("--plane-mb and --deadline-s must be > 0")
    run = Run(opts.json or default_json(opts.cpu), budget_s=0.0)
    run.figures.update(
        mode="cpu" if opts.cpu else "gpu",
        gpus=gpus,
        torch_version=torch.__version__,
        device_name=torch.cuda.get_device_name(0) if gpus else cli.cpu_model(),
    )
    run.say("gpu-node-check", f"{run.figures['mode']} mode, JSON -> {run.path}")
    with tempfile.TemporaryDirectory(prefix="gpu-node-check-") as tmp:
        work = Path(tmp)
        stage(run, "fsdp", lambda: fsdp_stage(opts.cpu, work))
        stage(run, "plane", lambda: plane_stage(opts.cpu, mb, work))
        stage(run, "plane_kill", lambda: kill_stage(opts.cpu, mb, deadline_s, work))
        for runner in ("v1", "v2_async"):
            stage(run, f"vllm_{runner}", lambda r=runner: vllm_stage(r, opts.cpu, work))
    names = ("fsdp", "plane", "plane_kill", "vllm_v1", "vllm_v2_async")
    failed = [n for n in names if run.figures[n]["passed"] is False]
    run.figures["failed_stages"] = failed
    run.write()
    run.say("gpu-node-check", f"failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

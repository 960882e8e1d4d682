"""scripts/gpu-check.sh in its CPU mode: the GPU machine's script end to end on tiny shapes, with
the packages that machine lacks (zmq, redis, vllm, hydra, ...) unimportable, so an import chain
or a code path that would break there breaks here first."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check import ABSENT_ON_DEVICE
from benchmarks.gpu_check.plan import CPU_PLAN
from testing.scripts import assert_refused, run_script

pytestmark = pytest.mark.integration


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return run_script("gpu-check.sh", *args, timeout=timeout)


def test_cpu_mode_writes_sane_figures(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = _run("--cpu", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "engine: batch 8" in proc.stdout  # progress lines as it goes
    fig = json.loads(out.read_text())
    assert fig["errors"] == []
    assert fig["mode"] == "cpu" and fig["device"] == "cpu" and fig["device_name"]
    assert fig["torch_version"] == torch.__version__
    assert set(fig["imports_blocked"]) == set(ABSENT_ON_DEVICE) >= {"zmq", "redis", "hydra"}

    # Every row at every batch size; ratios to plain; tokens per verification in [1, k + 1].
    k = fig["gpu_k"]
    assert fig["gpu_batches"] == list(CPU_PLAN.batches) and fig["gpu_skipped_batches"] == []
    rows = fig["gpu_rows"]
    fixed = ["ngram", "early_exit", "adapter", "hybrid"]
    eagle = ["eagle3", "eagle3_adaptive"]
    assert rows == ["none", *fixed, *(f"{n}_adaptive" for n in fixed), *eagle]
    for batch in CPU_PLAN.batches:
        assert fig[f"gpu_none_b{batch}_ratio"] == 1.0
        for name in rows:
            key = f"gpu_{name}_b{batch}"
            assert fig[f"{key}_tokens_per_s"] > 0 and fig[f"{key}_ratio"] > 0
            if name == "none":
                continue
            per_verify, accept = fig[f"{key}_tokens_per_verify"], fig[f"{key}_acceptance"]
            if not name.endswith("_adaptive"):  # fixed k verifies every step
                assert per_verify is not None, key
            else:  # the adaptive rows record the draft lengths they chose
                assert abs(sum(fig[f"{key}_draft_lengths"].values()) - 1.0) < 1e-2
            if per_verify is not None:
                assert 1.0 <= per_verify <= k + 1, (key, per_verify)
                assert 0.0 <= accept <= 1.0, (key, accept)
    spec_rows = [n for n in rows if n != "none"]
    b8 = {n: fig[f"gpu_{n}_b8_ratio"] for n in spec_rows}
    assert fig["lossless"] is True
    assert fig["lossless_min_pvalue"] >= fig["lossless_threshold"] > 0
    assert len(fig["lossless_pvalues"]) == 2 * len(rows)  # every row, two sampling settings
    assert fig["gpu_speedup_b8_best_lossless"] == max(b8.values()) == b8[fig["gpu_best_method_b8"]]
    assert fig["gpu_adaptive_min_ratio"] == min(
        fig[f"gpu_{n}_b{b}_ratio"] for n in spec_rows if "adaptive" in n for b in CPU_PLAN.batches
    )
    assert fig["gpu_tokens_per_verify_b8"] == fig["gpu_adapter_b8_tokens_per_verify"]

    # The engine model learned its structure, and the warm-up trained its draft.
    assert fig["structure_loss_last"] < 0.5 * fig["structure_loss_first"]
    assert fig["structure_loss_last"] < fig["structure_uniform_loss"]
    assert fig["draft_acceptance_after"] > fig["draft_acceptance_before"]
    # And its EAGLE-3 head (the same samples), whose rows the engine ran: tokens per verify and
    # the memory-bound ceiling computed from it and the head's share of the target's parameters.
    assert fig["eagle_acceptance_after"] > fig["eagle_acceptance_before"]
    assert 0 < fig["eagle_draft_param_frac"] < 1
    tpv = fig["gpu_eagle_tokens_per_verify_b8"]
    assert tpv == fig["gpu_eagle3_b8_tokens_per_verify"] and 1.0 <= tpv <= k + 1
    bound = tpv / (1 + k * fig["eagle_draft_param_frac"])
    assert fig["gpu_eagle_membound_bound_b8"] == pytest.approx(bound, abs=1e-3)

    assert fig["learner_step_s"] > 0 and fig["learner_tokens_per_s"] > 0
    assert fig["learner_completion_tokens"] > 0 and fig["learner_peak_mem_gb"] > 0
    assert fig["publish_store"] == "memory" and fig["weights_roundtrip_exact"] is True
    assert fig["weights_bytes"] >= 2 * fig["weights_params"]  # bf16
    assert fig["weights_publish_gbps"] > 0 and fig["weights_fetch_gbps"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_gpu_mode_refuses_a_machine_without_cuda(tmp_path: Path) -> None:
    assert_refused("gpu-check.sh", tmp_path / "gpu.json", "no CUDA device here", timeout=120)

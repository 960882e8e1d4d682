"""bf16 where the device computes it fast, fp32 where it does not.

A CPU without bf16 matrix instructions (AVX2 only: no AVX512-BF16, no AMX) emulates each bf16
matmul: a [64 x 576] x [576 x 1536] product took 119.9 ms in bf16 against 5.0 ms in fp32 on one
such core (24x), so a preset that trains and decodes in bf16 (``model=smollm2-135m``) would not
finish a learner step in minutes there. :func:`prepare` moves a process that computes on such a
CPU to fp32 unless the user named the setting on the command line: the learner's
``learner.precision`` (``bf16-mixed`` or ``bf16`` -> ``fp32``: fp32 compute, the master weights
and the published bf16 versions unchanged) and the torch engine's ``engine.torch_dtype``
(``auto`` -> ``float32``: the bf16 published weights are widened on load). Sampling stays exact
either way (the published weights are the same; only the arithmetic is wider).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from common.config.gpu_profile import named_keys, set_keys

if TYPE_CHECKING:
    import torch

    from common.config import SpecRLConfig

log = logging.getLogger(__name__)


def bf16_is_fast(device: torch.device) -> bool:
    """True where ``device`` has bf16 matrix instructions: a GPU that supports bf16, a CPU with
    AVX512-BF16 or AMX (oneDNN's own check). False where the check is missing or fails."""
    import torch

    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if not torch.backends.mkldnn.is_available():
        return False
    try:  # a private torch op (torch==2.13.0 is pinned): False where it is missing or fails
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError) as e:
        log.info("no bf16 check in this torch build (%r): bf16 counted as slow", e)
        return False


def fp32_changes(cfg: SpecRLConfig, overrides: Sequence[str], role: str) -> dict[str, str]:
    """The settings :func:`prepare` changes for ``role`` on a CPU without fast bf16: key -> new
    value (empty when bf16 is not in use or the user named it)."""
    named = named_keys(overrides)
    changes: dict[str, str] = {}
    if role == "learner" and cfg.learner.precision != "fp32":
        changes["learner.precision"] = "fp32"
    bf16_weights = cfg.learner.publish_dtype == "bfloat16"
    engine = cfg.engine
    if role == "actor" and engine.name == "torch" and engine.torch_dtype == "auto" and bf16_weights:
        changes["engine.torch_dtype"] = "float32"
    return {k: v for k, v in changes.items() if k not in named}


def prepare(cfg: SpecRLConfig, overrides: Sequence[str], role: str, cuda: bool) -> dict[str, str]:
    """Move ``role``'s bf16 compute to fp32 (in place, logged) when it computes on a CPU
    without fast bf16; the changes made (key -> value)."""
    import torch

    if cuda:
        return {}
    changes = fp32_changes(cfg, overrides, role)
    if not changes or bf16_is_fast(torch.device("cpu")):
        return {}
    set_keys(cfg, changes)
    log.warning(
        "this CPU has no bf16 matrix instructions (no AVX512-BF16 or AMX): bf16 arithmetic is "
        "emulated, far slower than fp32, so %s computes in fp32 (%s); name the setting "
        "on the command line to keep bf16",
        role,
        ", ".join(f"{k}={v}" for k, v in changes.items()),
    )
    return changes

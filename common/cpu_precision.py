"""bf16 where the device computes it fast, fp32 where it does not.

A CPU without bf16 matrix instructions (AVX2 only: no AVX512-BF16, no AMX) emulates each bf16
matmul: a [64 x 576] x [576 x 1536] product took 119.9 ms in bf16 against 5.0 ms in fp32 on one
such core (24x), so a preset that trains and decodes in bf16 (``model=smollm2-135m``) would not
finish a learner step in minutes there. The resolve step's ``precision`` layer
(``common/config/resolve.py``) moves a process that computes on such a CPU to fp32 unless the
user named the setting on the command line: the learner's
``learner.precision`` (``bf16-mixed`` or ``bf16`` -> ``fp32``: fp32 compute, the master weights
and the published bf16 versions unchanged) and the torch engine's ``engine.torch_dtype``
(``auto`` -> ``float32``: the bf16 published weights are widened on load). Sampling stays exact
either way (the published weights are the same; only the arithmetic is wider).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

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

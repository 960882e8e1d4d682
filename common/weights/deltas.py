"""Sparse deltas between two versions of the same tensors, bit-exact.

Per tensor a delta stores nothing (bit-identical), the changed elements (flat int32/int64
indices and their new values) or, where that is not smaller, the whole tensor. Bits are
compared, not values, so NaN payloads and -0.0 survive.
"""

from __future__ import annotations

from collections.abc import Mapping

import safetensors.torch
import torch

from common.weights.format import WeightsCorrupt

# Tensor names inside a delta's safetensors blob: the changed elements' flat indices and values,
# or the whole new tensor.
_IDX, _VAL, _DENSE = "idx/", "val/", "dense/"
# A delta larger than this fraction of the full weights is written as a full version instead.
_MAX_DELTA_FRACTION = 0.5


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat as same-width integers: compares bits (NaN, -0.0) rather than values."""
    flat = t.reshape(-1)
    by_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.dtype == torch.bool or t.element_size() not in by_size:
        return flat.view(torch.uint8) if t.dtype == torch.bool else flat
    return flat.view(by_size[t.element_size()])


def encode_delta(
    base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a delta blob from ``base`` to ``new`` and each tensor's encoding: "same"
    (bit-identical), "sparse" (changed flat indices + values) or "dense" (the whole tensor,
    where that is no larger)."""
    blob: dict[str, torch.Tensor] = {}
    encoding: dict[str, str] = {}
    for name, t in new.items():
        b = base[name]
        changed = torch.nonzero(_bits(t) != _bits(b)).reshape(-1)  # [k]
        k = changed.numel()
        if k == 0:
            encoding[name] = "same"
            continue
        index_dtype = torch.int32 if t.numel() < 2**31 else torch.int64
        if k * (index_dtype.itemsize + t.element_size()) < t.numel() * t.element_size():
            blob[_IDX + name] = changed.to(index_dtype)
            blob[_VAL + name] = t.reshape(-1)[changed]
            encoding[name] = "sparse"
        else:
            blob[_DENSE + name] = t.contiguous()
            encoding[name] = "dense"
    return blob, encoding


def delta_bytes(
    base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> tuple[bytes, dict[str, str]] | None:
    """The safetensors bytes of the delta from ``base`` to ``new`` and its encoding, or None
    where it would not save enough: a delta that saves little (every element moved, as with
    fp32 weights) costs a digest check on every reader and lengthens the chain Redis keeps."""
    blob, encoding = encode_delta(base, new)
    data = safetensors.torch.save(blob)
    full_bytes = sum(t.numel() * t.element_size() for t in new.values())
    if len(data) > _MAX_DELTA_FRACTION * full_bytes:
        return None
    return data, encoding


def _sparse_entry(
    version: int, name: str, b: torch.Tensor, blob: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``b`` with the changed elements of a "sparse" entry written in (``b`` left untouched)."""
    idx, val = blob.get(_IDX + name), blob.get(_VAL + name)
    if (
        idx is None
        or val is None
        or idx.dim() != 1
        or idx.dtype not in (torch.int32, torch.int64)
        or val.shape != idx.shape
        or val.dtype != b.dtype
    ):
        raise WeightsCorrupt(f"version {version}: delta entry {name} is malformed")
    idx = idx.long()
    if idx.numel() and not (int(idx.min()) >= 0 and int(idx.max()) < b.numel()):
        raise WeightsCorrupt(f"version {version}: delta indices of {name} out of range")
    flat = b.reshape(-1).clone()
    flat[idx] = val
    return flat.view(b.shape)


def apply_delta(
    version: int,
    base: Mapping[str, torch.Tensor],
    blob: Mapping[str, torch.Tensor],
    encoding: Mapping[str, str],
) -> dict[str, torch.Tensor]:
    """The full state of ``version``: ``base`` (left untouched) with ``blob`` applied."""
    if set(encoding) != set(base):
        raise WeightsCorrupt(f"version {version}: the delta's tensors differ from its base's")
    out: dict[str, torch.Tensor] = {}
    for name, how in encoding.items():
        b = base[name]
        if how == "same":
            out[name] = b
        elif how == "dense":
            t = blob.get(_DENSE + name)
            if t is None or t.shape != b.shape or t.dtype != b.dtype:
                raise WeightsCorrupt(f"version {version}: delta entry {name} is malformed")
            out[name] = t
        elif how == "sparse":
            out[name] = _sparse_entry(version, name, b, blob)
        else:
            raise WeightsCorrupt(f"version {version}: unknown delta encoding {how!r} of {name}")
    return out

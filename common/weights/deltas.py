"""Applying a sparse, bit-exact delta between two versions of the same tensors (format:
docs/design.md §6.3; common/weights/publish/writer.py encodes them). Per tensor "same", "sparse" (flat
int32/int64 indices and their new values) or "dense" (the whole tensor).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from common.weights.format import WeightsCorrupt

# Tensor names inside a delta's safetensors blob: the changed elements' flat indices and values,
# or the whole new tensor.
IDX, VAL, DENSE = "idx/", "val/", "dense/"


def _sparse_entry(
    version: int, name: str, b: torch.Tensor, blob: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``b`` with the changed elements of a "sparse" entry written in (``b`` left untouched)."""
    idx, val = blob.get(IDX + name), blob.get(VAL + name)
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
            t = blob.get(DENSE + name)
            if t is None or t.shape != b.shape or t.dtype != b.dtype:
                raise WeightsCorrupt(f"version {version}: delta entry {name} is malformed")
            out[name] = t
        elif how == "sparse":
            out[name] = _sparse_entry(version, name, b, blob)
        else:
            raise WeightsCorrupt(f"version {version}: unknown delta encoding {how!r} of {name}")
    return out

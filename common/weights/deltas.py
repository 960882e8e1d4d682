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
    version: int,
    name: str,
    b: torch.Tensor,
    blob: Mapping[str, torch.Tensor],
    in_place: bool = False,
) -> torch.Tensor:
    """``b`` with the changed elements of a "sparse" entry written in: into ``b`` itself when
    ``in_place``, else into a copy (``b`` left untouched)."""
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
    flat = b.view(-1) if in_place and b.is_contiguous() else b.reshape(-1).clone()
    flat[idx] = val
    return flat.view(b.shape)


def apply_delta(
    version: int,
    base: Mapping[str, torch.Tensor],
    blob: Mapping[str, torch.Tensor],
    encoding: Mapping[str, str],
    in_place: bool = False,
) -> dict[str, torch.Tensor]:
    """The full state of ``version``: ``base`` with ``blob`` applied. ``in_place``: the
    changed elements are written into ``base``'s own tensors (a "dense" entry copied into
    them), so a delta costs no copy of the tensors it changes; only for a base that no one
    else holds. Otherwise ``base`` is left untouched."""
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
            out[name] = b.copy_(t) if in_place else t
        elif how == "sparse":
            out[name] = _sparse_entry(version, name, b, blob, in_place)
        else:
            raise WeightsCorrupt(f"version {version}: unknown delta encoding {how!r} of {name}")
    return out

"""safetensors files written tensor by tensor, never holding a second copy of the whole state.

``safetensors.torch.save``/``save_file`` first turn every tensor into a ``bytes`` object, so
writing a state holds it twice at once: for the learner's AdamW moments of a 135M-parameter model
that is 1 GB more at every checkpoint, and for a published version its size more in the upload
process. The format is small (an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes), so these writers lay it out themselves,
in the library's order (largest element size first, then name) and with its 8-byte alignment;
``safetensors`` reads what they write (tests/unit/common/test_safetensors_io.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def writable(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether every tensor has a dtype these writers know (others: use the library)."""
    return all(t.dtype in DTYPE_NAMES for t in tensors.values())


def _layout(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> tuple[list[str], bytes, int]:
    """(tensor order, the header with its length prefix, bytes of data)."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    return order, len(text).to_bytes(8, "little") + text, offset


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU view (a copy only if it is not contiguous)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def safetensors_bytes(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> bytearray:
    """The safetensors file of ``tensors`` in one buffer (the state's bytes exist once more)."""
    order, head, size = _layout(tensors, metadata)
    out = bytearray(len(head) + size)
    out[: len(head)] = head
    if size:
        body = torch.frombuffer(out, dtype=torch.uint8)[len(head) :]
        position = 0
        for name in order:
            raw = _raw(tensors[name])
            body[position : position + raw.numel()].copy_(raw)
            position += raw.numel()
    return out


def save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | Path,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` to ``path`` one tensor at a time (no copy of the whole state)."""
    order, head, _ = _layout(tensors, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for name in order:
            raw = _raw(tensors[name])
            if raw.numel():
                f.write(memoryview(raw.numpy()))

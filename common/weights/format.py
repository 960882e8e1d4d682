"""The bytes of a weights version: errors, the full-weights digest, the finite check, and
safetensors written and read without a second copy of the state.

``safetensors.torch.save``/``save_file`` first turn every tensor into a ``bytes`` object, so
writing a state holds it twice at once (for a checkpoint's optimizer moments, or a published
version in the upload process). The format is small (an 8-byte little-endian header length, a
JSON header naming each tensor's dtype, shape and byte range, then the bytes), so the writers
here (and learner/checkpoint.py's) lay it out themselves, in the library's order (largest element size first, then name) and
with its 8-byte alignment; ``safetensors`` reads what they write
(tests/unit/common/test_safetensors_io.py). The reader returns zero-copy views into one buffer.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import safetensors.torch
import torch
from safetensors import SafetensorError


class WeightsError(RuntimeError):
    """A version is missing, expired, or cannot be published."""


class WeightsCorrupt(WeightsError):
    """Stored bytes disagree with their manifest: checksum, shape, dtype or a missing chunk."""


class WeightsNonFinite(WeightsError):
    """A version holds NaN or infinity: never published, and refused by every reader."""


# safetensors dtype names -> torch dtypes (as in ``safetensors.torch``; left out where this torch
# lacks the dtype). A name missing here is read through ``safetensors.torch.load`` (a copy).
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "C64": torch.complex64,
        "U64": getattr(torch, "uint64", None),
        "U32": getattr(torch, "uint32", None),
        "U16": getattr(torch, "uint16", None),
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E4M3FNUZ": getattr(torch, "float8_e4m3fnuz", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E5M2FNUZ": getattr(torch, "float8_e5m2fnuz", None),
    }.items()
    if dtype is not None
}

DTYPE_NAMES: dict[torch.dtype, str] = {
    _SAFETENSORS_DTYPES[name]: name
    for name in ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")
}
"""The dtypes the writers here know, with their safetensors names."""


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of ``dtype``: "float32", "bfloat16", "int64"."""
    return str(dtype).removeprefix("torch.")


MAX_PUBLISH_THREADS = 16


def publish_threads() -> int:
    """Threads a writer hashes and serialises a version on: the cores this process may run on,
    at most ``MAX_PUBLISH_THREADS`` (hashlib and torch's copies release the GIL)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_PUBLISH_THREADS, cores))


def threaded_map(fn, items: list, threads: int) -> list:
    """``[fn(x) for x in items]``, on ``threads`` threads where more than one."""
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(threads, len(items))) as pool:
        return list(pool.map(fn, items))


def weights_digest(state_dict: Mapping[str, torch.Tensor], threads: int = 0) -> str:
    """sha256 over (name, dtype, shape, sha256 of the raw bytes) of every tensor, names sorted.

    Independent of how the tensors were obtained (a full fetch, deltas, the learner's snapshot);
    the per-tensor hashes run on ``threads`` threads (0: up to 4, one per core; hashlib releases
    the GIL).
    """
    threads = threads or max(1, min(4, os.cpu_count() or 1))
    names = sorted(state_dict)
    tensors = [state_dict[n].detach().to("cpu").contiguous() for n in names]

    def digest(t: torch.Tensor) -> bytes:
        return hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy())).digest()

    digests = threaded_map(digest, tensors, threads)
    outer = hashlib.sha256()
    for name, t, d in zip(names, tensors, digests, strict=True):
        outer.update(json.dumps([name, dtype_name(t.dtype), list(t.shape)]).encode() + d)
    return outer.hexdigest()


FINITE_BLOCK = 2**25
"""Elements per block of the threaded finite check (a big tensor is split among threads)."""


def _finite_blocks(state_dict: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The floating tensors of ``state_dict`` as flat blocks of at most ``FINITE_BLOCK``."""
    blocks = []
    for name, t in state_dict.items():
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            continue
        flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
        blocks += [(name, flat[i : i + FINITE_BLOCK]) for i in range(0, len(flat), FINITE_BLOCK)]
    return blocks


def _finite(block: tuple[str, torch.Tensor]) -> int:
    """Non-finite values in one block (0 in one pass where it has none)."""
    _, t = block
    # One pass without a temporary: min and max propagate a NaN, and an infinity is one of
    # them (20x the rate of a float32 sum of bf16 on a CPU core). Complex tensors have no
    # order: a NaN or an infinity makes their sum non-finite, and a finite tensor whose sum
    # overflows takes the exact count below.
    if t.is_complex():
        finite = bool(torch.isfinite(t.sum()))
    else:
        low, high = torch.aminmax(t)
        finite = bool(torch.isfinite(low)) and bool(torch.isfinite(high))
    return 0 if finite else int((~torch.isfinite(t)).sum())


def check_finite(version: int, state_dict: Mapping[str, torch.Tensor], threads: int = 1) -> None:
    """Raise ``WeightsNonFinite`` naming the first floating tensor with a NaN or an infinity;
    the blocks are checked on ``threads`` threads (torch's reductions release the GIL)."""
    blocks = _finite_blocks(state_dict)
    bad: dict[str, int] = {}
    for (name, _), count in zip(blocks, threaded_map(_finite, blocks, threads), strict=True):
        if count:
            bad[name] = bad.get(name, 0) + count
    if bad:
        name, count = next(iter(bad.items()))
        raise WeightsNonFinite(
            f"version {version}: tensor {name} has {count} non-finite value(s) (NaN/inf)"
        )


# ------------------------------------------------------------------------------------ write


def writable(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether every tensor has a dtype these writers know (others: use the library)."""
    return all(t.dtype in DTYPE_NAMES for t in tensors.values())


def safetensors_layout(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> tuple[list[str], bytes, int]:
    """(tensor order, the header with its length prefix, bytes of data) of the safetensors file
    of ``tensors``; the data is each tensor's ``raw_bytes`` in that order."""
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


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU view (a copy only if it is not contiguous)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def safetensors_bytes(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    threads: int = 1,
) -> bytearray:
    """The safetensors file of ``tensors`` in one buffer (the state's bytes exist once more);
    the tensors are copied in on ``threads`` threads (each to its own byte range)."""
    order, head, size = safetensors_layout(tensors, metadata)
    out = bytearray(len(head) + size)
    out[: len(head)] = head
    if size:
        body = torch.frombuffer(out, dtype=torch.uint8)[len(head) :]
        ranges, position = [], 0
        for name in order:
            raw = raw_bytes(tensors[name])
            ranges.append((raw, position))
            position += raw.numel()

        def put(item: tuple[torch.Tensor, int]) -> None:
            raw, start = item
            body[start : start + raw.numel()].copy_(raw)

        threaded_map(put, ranges, threads)
    return out


def serialize_state_dict(
    state_dict: Mapping[str, torch.Tensor], threads: int = 1
) -> bytes | bytearray:
    """safetensors bytes of ``state_dict`` as contiguous CPU tensors (copied on ``threads``).

    Tensors that share storage (tied embedding / LM head) are cloned, because safetensors refuses
    shared storage; the reader gets separate tensors, which ``load_state_dict`` handles.
    """
    seen_storages: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storages and t.numel() > 0:
            t = t.clone()
        seen_storages.add(ptr)
        tensors[name] = t
    if not writable(tensors):
        return safetensors.torch.save(tensors)
    return safetensors_bytes(tensors, threads=threads)


def safetensors_chunks(
    state_dict: Mapping[str, torch.Tensor], size: int
) -> tuple[int, Iterator[bytearray]]:
    """The bytes :func:`serialize_state_dict` gives, as ``size``-byte pieces made one at a time
    (the last may be shorter), and their total: the file never exists whole, so a version
    uploads holding one piece beside its tensors instead of a second copy of them."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state_dict.items()}
    if not writable(tensors):
        data = serialize_state_dict(tensors)
        view = memoryview(data)
        return len(data), (bytearray(view[i : i + size]) for i in range(0, len(data), size))
    order, head, body = safetensors_layout(tensors, None)
    total = len(head) + body

    def pieces() -> Iterator[bytearray]:
        sources = [torch.frombuffer(bytearray(head), dtype=torch.uint8)]
        sources += [raw_bytes(tensors[name]) for name in order]
        left = total
        out = bytearray(min(size, left))
        target = torch.frombuffer(out, dtype=torch.uint8)  # one view per piece
        filled = 0
        for source in sources:
            taken, n = 0, source.numel()
            while taken < n:
                step = min(len(out) - filled, n - taken)
                target[filled : filled + step].copy_(source[taken : taken + step])
                filled, taken = filled + step, taken + step
                if filled == len(out):
                    del target  # no view left on the piece handed out (it stays resizable)
                    yield out
                    left -= filled
                    if left == 0:
                        return
                    out, filled = bytearray(min(size, left)), 0
                    target = torch.frombuffer(out, dtype=torch.uint8)

    return total, pieces()


# ------------------------------------------------------------------------------------- read


def _header(version: int, raw) -> tuple[dict, int]:
    """The parsed safetensors header of ``raw`` (uint8 numpy) and where the data starts."""
    total = len(raw)
    header_len = int.from_bytes(raw[:8].tobytes(), "little") if total >= 8 else -1
    if not 0 <= header_len <= total - 8:
        raise WeightsCorrupt(f"version {version}: not safetensors bytes (header length)")
    try:
        header = json.loads(raw[8 : 8 + header_len].tobytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightsCorrupt(f"version {version}: safetensors header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise WeightsCorrupt(f"version {version}: safetensors header is not a JSON object")
    return header, 8 + header_len


def tensors_from_safetensors(version: int, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors over ``buf`` (uint8, safetensors bytes) without copying: views of its storage.

    A tensor whose offset is not aligned to its element size (safetensors does not promise it)
    is copied; a dtype this module does not know goes through ``safetensors.torch.load``.
    """
    raw = buf.numpy()
    header, base = _header(version, raw)
    data_bytes = len(raw) - base
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_label = spec["dtype"]
            shape = [int(d) for d in spec["shape"]]
            begin, end = (int(o) for o in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsCorrupt(f"version {version}: safetensors entry {name!r}: {e!r}") from e
        dtype = _SAFETENSORS_DTYPES.get(dtype_label)
        if dtype is None:
            try:
                return safetensors.torch.load(raw.tobytes())
            except SafetensorError as e:
                raise WeightsCorrupt(f"version {version}: safetensors cannot parse: {e}") from e
        if (
            any(d < 0 for d in shape)
            or not 0 <= begin <= end <= data_bytes
            or end - begin != math.prod(shape) * dtype.itemsize
        ):
            raise WeightsCorrupt(
                f"version {version}: safetensors entry {name!r} ({dtype_label}, {shape}) does "
                f"not fit its bytes [{begin}, {end})"
            )
        flat = buf[base + begin : base + end]
        if (base + begin) % dtype.itemsize:
            flat = flat.clone()
        tensors[name] = flat.view(dtype).view(shape)
    return tensors

"""The manifest of a stored version (its fields: docs/design.md §6.2): written last, read first,
checked before use. ``chunks_sha256`` ties the chunk list together, so one hash per byte
suffices on both sides."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from common.weights.format import WeightsCorrupt, WeightsError, dtype_name

MANIFEST_FORMAT = 3

_M = TypeVar("_M", bound=Mapping[str, Any])


def sha256_of(data: memoryview) -> bytes:
    """The sha256 of one chunk."""
    return hashlib.sha256(data).digest()


def digest_of_digests(chunk_sha256: list[str]) -> str:
    """sha256 over the concatenated chunk digests: one checksum for the whole version."""
    return hashlib.sha256(b"".join(bytes.fromhex(h) for h in chunk_sha256)).hexdigest()


def parse_manifest(raw: bytes | str, what: str) -> dict[str, Any]:
    """A manifest as stored in Redis, parsed; raises ``WeightsCorrupt`` naming ``what`` unless it
    is a JSON object."""
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightsCorrupt(f"{what} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict):
        raise WeightsCorrupt(f"{what} is not a JSON object")
    return manifest


def check_format(
    manifest: _M | None, expected: int, missing: str, wrong: Callable[[Any], str]
) -> _M:
    """``manifest``, unless it is None (``WeightsError(missing)``) or of a format other than
    ``expected`` (``WeightsError(wrong(the format it has))``): a reader's first check of a
    manifest it read from Redis."""
    if manifest is None:
        raise WeightsError(missing)
    if manifest.get("format") != expected:
        raise WeightsError(wrong(manifest.get("format")))
    return manifest


def check_manifest(run_id: str, version: int, manifest: dict[str, Any] | None) -> dict[str, Any]:
    """``manifest`` if it is one this reader can use; raises ``WeightsError`` if it is missing
    or of another format, ``WeightsCorrupt`` if it is malformed."""
    where = f"weights version {version} of run {run_id!r}"

    def wrong(found: Any) -> str:
        return f"{where} has manifest format {found!r}; this reader reads format {MANIFEST_FORMAT}"

    manifest = check_format(manifest, MANIFEST_FORMAT, f"{where} not found", wrong)
    kind = manifest.get("kind")
    digest = manifest.get("weights_sha256")
    if kind not in ("full", "delta") or not isinstance(digest, str) or len(digest) != 64:
        raise WeightsCorrupt(f"manifest of version {version} is malformed (kind/digest)")
    if not isinstance(manifest.get("keyframe"), int) or not isinstance(
        manifest.get("tensors"), dict
    ):
        raise WeightsCorrupt(f"manifest of version {version} is malformed (keyframe/tensors)")
    if kind == "delta" and not (
        isinstance(manifest.get("base"), int)
        and isinstance(manifest.get("base_sha256"), str)
        and isinstance(manifest.get("encoding"), dict)
    ):
        raise WeightsCorrupt(f"manifest of delta version {version} is malformed (base)")
    return manifest


def chunk_list(version: int, manifest: Mapping[str, Any]) -> tuple[list[str], int]:
    """The chunk digests and total bytes ``manifest`` lists, checked against its
    ``chunks_sha256``."""
    try:
        num_chunks = int(manifest["num_chunks"])
        chunk_sha256 = [str(h) for h in manifest["chunk_sha256"]]
        chunks_sha256 = str(manifest["chunks_sha256"])
        total_bytes = int(manifest["total_bytes"])
        listed = digest_of_digests(chunk_sha256)
    except (KeyError, TypeError, ValueError) as e:
        raise WeightsCorrupt(f"manifest of version {version} is malformed: {e!r}") from e
    if len(chunk_sha256) != num_chunks or total_bytes < 0:
        raise WeightsCorrupt(
            f"version {version}: manifest lists {len(chunk_sha256)} checksums for "
            f"{num_chunks} chunks ({total_bytes} bytes)"
        )
    if listed != chunks_sha256:
        raise WeightsCorrupt(
            f"version {version}: the chunk checksums hash to {listed[:12]}…, manifest "
            f"chunks_sha256 says {chunks_sha256[:12]}…"
        )
    return chunk_sha256, total_bytes


def check_against_manifest(
    version: int, state_dict: Mapping[str, torch.Tensor], expected: Mapping[str, Mapping[str, Any]]
) -> dict[str, torch.Tensor]:
    """``state_dict`` in the manifest's tensor order, once its names, shapes and dtypes are the
    ones the manifest lists."""
    if set(state_dict) != set(expected):
        missing = sorted(set(expected) - set(state_dict))
        extra = sorted(set(state_dict) - set(expected))
        raise WeightsCorrupt(
            f"version {version}: tensor names differ: missing {missing}, extra {extra}"
        )
    for name, tensor in state_dict.items():
        spec = expected[name]
        if list(tensor.shape) != list(spec.get("shape", ())):
            raise WeightsCorrupt(
                f"version {version}: {name} has shape {list(tensor.shape)}, manifest says "
                f"{spec.get('shape')}"
            )
        if dtype_name(tensor.dtype) != spec.get("dtype"):
            raise WeightsCorrupt(
                f"version {version}: {name} has dtype {dtype_name(tensor.dtype)}, manifest says "
                f"{spec.get('dtype')}"
            )
    return {name: state_dict[name] for name in expected}


BYTES_FIELDS = (
    "kind",
    "keyframe",
    "base",
    "base_sha256",
    "encoding",
    "num_chunks",
    "chunk_sha256",
    "chunks_sha256",
    "total_bytes",
)
"""The manifest fields a bytes record brings (a reader takes no other field from it)."""


def merge_bytes_record(manifest: dict[str, Any], raw: bytes | None, what: str) -> dict[str, Any]:
    """``manifest`` with its bytes record (``raw``, None: not stored yet) merged in: a
    manifest committed before its Redis bytes (``redis_bytes: "pending"``, the node-local
    plane: docs/design.md §6.5) reads, once they are stored, like one committed with them.
    Raises ``WeightsCorrupt`` naming ``what`` for a record that is not a JSON object."""
    if manifest.get("redis_bytes") != "pending" or raw is None:
        return manifest
    record = parse_manifest(raw, what)
    merged = dict(manifest)
    merged.update({k: record[k] for k in BYTES_FIELDS if k in record})
    merged["redis_bytes"] = "stored"
    return merged

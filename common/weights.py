"""The Redis weight store (docs/design.md §6): versioned, chunked, checksummed safetensors bytes.

Write order is the whole consistency story:

1. chunks of one version (each with a TTL, so a writer that dies here leaves no garbage);
2. one atomic Lua commit that checks every chunk is present, makes the chunks permanent, writes
   the manifest, moves ``latest`` forward only, adds the version to the versions zset and
   announces it on the channel.

So a reader that follows ``latest`` (or any manifest) only ever sees complete versions, and
``latest`` never goes backwards even with two writers. Retention deletes a whole version (manifest
and chunks) in one transaction.

Reading streams the chunks (a few GETs in flight, so Redis never holds a whole model in one
client's output buffer) straight into one preallocated buffer, and checks every chunk against the
manifest's sha256 as it lands. Every byte is therefore verified, and a read can never assemble a
torn mix: a chunk from anything but this version fails its checksum, and a chunk that vanished
mid-read means the version was pruned (manifest gone too: ``WeightsError``) or lost
(``WeightsCorrupt``). The manifest's own ``chunks_sha256`` (sha256 over the chunk digests) ties
the chunk list together, so one hash per byte suffices on both sides. Tensors come back as
zero-copy views into that buffer (one storage for the whole state dict).

Deltas (``keyframe_every > 1``): a version is either a *full* version (a keyframe) or a sparse
*delta* against the version before it. Per tensor a delta stores nothing (bit-identical), the
changed elements (flat int32/int64 indices and their new values) or, where that is not smaller,
the whole tensor. Bits are compared, not values, so the result is bit-exact. The manifest of every
version carries ``weights_sha256``, a digest of the full resulting weights (per-tensor sha256 of
the raw bytes, hashed with names, dtypes and shapes): a reader that applied deltas checks it, so a
wrong, tampered or missing delta is refused, never loaded. A reader holding the delta's base
applies it; any other walks back to the chain's keyframe (retention keeps every version from the
keyframe of the oldest retained version on). Every reader refuses non-finite floating tensors
(after decoding, and after applying a delta), and ``publish`` refuses to write them.

Each ``WeightStore`` remembers the last version it published (the base of the next delta) and the
last it fetched (so the next fetch can be a delta); a process uses one store per run.
With a ``HostCache`` the processes of one host share each fetched version (full bytes in
``/dev/shm``), so Redis sends a version once per host (``common/weight_cache.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import mmap
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis
import redis.connection
import safetensors.torch
import torch
from safetensors import SafetensorError

from common.config import RedisConfig
from common.protocol import (
    weights_channel,
    weights_chunk_key,
    weights_latest_key,
    weights_manifest_key,
    weights_versions_key,
)
from common.safetensors_io import safetensors_bytes, writable
from common.weight_cache import HostCache

logger = logging.getLogger(__name__)

# 2: one sha256 per chunk plus ``chunks_sha256`` over the chunk digests (1 also hashed the whole
# blob, which doubled the hashing for no extra guarantee).
# 3: ``kind`` full/delta, ``base``/``base_sha256``/``keyframe`` for deltas and their per-tensor
# ``encoding``, ``weights_sha256`` of the full resulting weights, ``dtype`` of the published floats.
MANIFEST_FORMAT = 3
# Tensor names inside a delta's safetensors blob: the changed elements' flat indices and values,
# or the whole new tensor.
_IDX, _VAL, _DENSE = "idx/", "val/", "dense/"
# A delta larger than this fraction of the full weights is written as a full version instead.
_MAX_DELTA_FRACTION = 0.5

# Chunk GETs in flight while fetching: Redis builds the next reply while we receive this one.
_FETCH_WINDOW = 2
# Chunk GETs per round trip on the fallback (plain redis-py) path.
_FALLBACK_BATCH = 8
# Longest RESP status line we accept (``$<length>``, ``-ERR ...``) before calling it garbage.
_MAX_RESP_LINE = 64 * 1024

# safetensors dtype names -> torch dtypes (as in ``safetensors.torch``; None where this torch lacks
# the dtype). A name missing here falls back to ``safetensors.torch.load`` (a copy).
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

# KEYS[1]=latest KEYS[2]=versions zset KEYS[3]=manifest KEYS[4..]=chunks
# ARGV[1]=version ARGV[2]=manifest json ARGV[3]=channel
# Returns {1, version} on commit, {0, current latest} if not newer, {-1, key} if a chunk is gone.
_COMMIT_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur and tonumber(cur) >= tonumber(ARGV[1]) then return {0, cur} end
for i = 4, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return {-1, KEYS[i]} end
end
for i = 4, #KEYS do redis.call('PERSIST', KEYS[i]) end
redis.call('SET', KEYS[3], ARGV[2])
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
redis.call('PUBLISH', ARGV[3], ARGV[1])
return {1, ARGV[1]}
"""


class WeightsError(RuntimeError):
    """A version is missing, expired, or cannot be published."""


class WeightsCorrupt(WeightsError):
    """Stored bytes disagree with their manifest: checksum, shape, dtype or a missing chunk."""


class WeightsNonFinite(WeightsError):
    """A version holds NaN or infinity: never published, and refused by every reader."""


@dataclass
class _Held:
    """A full version this store published or fetched: the base of the next delta."""

    version: int
    digest: str
    state: dict[str, torch.Tensor]
    keyframe: int


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

    if threads == 1:
        digests = [digest(t) for t in tensors]
    else:
        with ThreadPoolExecutor(threads) as pool:
            digests = list(pool.map(digest, tensors))
    outer = hashlib.sha256()
    for name, t, d in zip(names, tensors, digests, strict=True):
        outer.update(json.dumps([name, _dtype_name(t.dtype), list(t.shape)]).encode() + d)
    return outer.hexdigest()


def check_finite(version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise ``WeightsNonFinite`` naming the first floating tensor with a NaN or an infinity."""
    for name, t in state_dict.items():
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            continue
        # One pass without a temporary: a NaN or an infinity makes the sum non-finite. A finite
        # tensor whose sum overflows (never seen in weights) takes the exact check below.
        # 16-bit floats accumulate in float32, whose range their sums cannot leave.
        widen = t.element_size() < 4 and not t.is_complex()
        total = t.sum(dtype=torch.float32) if widen else t.sum()
        if bool(torch.isfinite(total)):
            continue
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise WeightsNonFinite(
                f"version {version}: tensor {name} has {bad} non-finite value(s) (NaN/inf)"
            )


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
            out[name] = flat.view(b.shape)
        else:
            raise WeightsCorrupt(f"version {version}: unknown delta encoding {how!r} of {name}")
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # "float32", "bfloat16", "int64"


def serialize_state_dict(state_dict: Mapping[str, torch.Tensor]) -> bytes | bytearray:
    """safetensors bytes of ``state_dict`` as contiguous CPU tensors.

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
    return safetensors_bytes(tensors)


class WeightStore:
    """Publishes and fetches versions of a state dict for one run."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        chunk_bytes: int = 8 * 2**20,
        retention: int = 3,
        pending_ttl_s: int = 600,
        keyframe_every: int = 1,
        host_cache: HostCache | None = None,
        retention_bytes: int = 0,
    ) -> None:
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("WeightStore needs a redis client with decode_responses=False")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        if retention < 1:
            raise ValueError(f"retention must be >= 1 (the latest is always kept), got {retention}")
        if retention_bytes < 0:
            raise ValueError(f"retention_bytes must be >= 0 (0: no bound), got {retention_bytes}")
        if pending_ttl_s <= 0:
            raise ValueError(f"pending_ttl_s must be > 0, got {pending_ttl_s}")
        if keyframe_every < 1:
            raise ValueError(f"keyframe_every must be >= 1 (1: no deltas), got {keyframe_every}")
        self.client = client
        self.run_id = run_id
        self.chunk_bytes = chunk_bytes
        self.retention = retention
        self.retention_bytes = retention_bytes
        self.pending_ttl_s = pending_ttl_s
        self.keyframe_every = keyframe_every
        self.host_cache = host_cache
        self._commit_script = client.register_script(_COMMIT_LUA)
        self._published: _Held | None = None  # base of the next delta we write
        self._fetched: _Held | None = None  # what the next delta we read may apply to
        self.last_publish_bytes = 0
        """Bytes written for the last published version (a delta's, or the full size)."""

    def recipe(self) -> dict[str, Any]:
        """What another process needs to build an equal store (``WeightStore.from_recipe``): the
        Redis connection's class and arguments and this store's settings. The host cache and
        what the store remembers (delta bases) stay behind."""
        pool = self.client.connection_pool
        return {
            "connection_class": pool.connection_class,
            "connection_kwargs": _portable_kwargs(pool.connection_kwargs),
            "run_id": self.run_id,
            "chunk_bytes": self.chunk_bytes,
            "retention": self.retention,
            "retention_bytes": self.retention_bytes,
            "pending_ttl_s": self.pending_ttl_s,
            "keyframe_every": self.keyframe_every,
        }

    @classmethod
    def from_recipe(cls, recipe: Mapping[str, Any]) -> WeightStore:
        settings = dict(recipe)
        pool = redis.ConnectionPool(
            connection_class=settings.pop("connection_class"),
            **settings.pop("connection_kwargs"),
        )
        return cls(redis.Redis(connection_pool=pool), **settings)

    # ------------------------------------------------------------------------------- publish

    def publish(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        meta: Mapping[str, str | int | float] | None = None,
        snapshot: bool = True,
    ) -> None:
        """Write ``version`` and make it the latest; raises ``WeightsError`` unless it is newer,
        ``WeightsNonFinite`` (writing nothing) if a floating tensor holds NaN or infinity.

        With ``keyframe_every > 1`` the version is written as a delta against the previous one
        when that is still the latest, and in full every ``keyframe_every`` versions. The store
        keeps the published tensors as the next delta's base: a copy when ``snapshot`` (False:
        the caller hands them over and will not modify them).
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise WeightsError(f"version must be a non-negative int, got {version!r}")
        current = self.latest_version()
        if current is not None and version <= current:
            raise WeightsError(
                f"refusing to publish version {version} for run {self.run_id!r}: latest is "
                f"{current} and versions only grow"
            )
        state = {name: t.detach().to("cpu").contiguous() for name, t in state_dict.items()}
        check_finite(version, state)
        # One thread: publishing runs beside a training step and should take one core at most.
        digest = weights_digest(state, threads=1)
        spec = {
            name: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
            for name, t in state.items()
        }
        base = self._published
        delta = (
            self.keyframe_every > 1
            and base is not None
            and base.version == current
            and version - base.keyframe < self.keyframe_every
            and {n: (t.shape, t.dtype) for n, t in base.state.items()}
            == {n: (t.shape, t.dtype) for n, t in state.items()}
        )
        encoding: dict[str, str] = {}
        data = b""
        if delta:
            assert base is not None
            blob, encoding = encode_delta(base.state, state)
            data = safetensors.torch.save(blob)
            # A delta that saves little (every element moved, as with fp32 weights) costs a
            # digest check on every reader and lengthens the chain Redis keeps: write it full.
            full_bytes = sum(t.numel() * t.element_size() for t in state.values())
            delta = len(data) <= _MAX_DELTA_FRACTION * full_bytes
        if not delta:
            data = serialize_state_dict(state)
        view = memoryview(data)
        chunks = [view[i : i + self.chunk_bytes] for i in range(0, len(data), self.chunk_bytes)]
        chunk_keys = [weights_chunk_key(self.run_id, version, i) for i in range(len(chunks))]
        # Hash on a helper thread (hashlib releases the GIL) while the chunks go out; the
        # digests are only needed by the manifest, which is written last.
        with ThreadPoolExecutor(1, thread_name_prefix="weights-sha256") as hasher:
            digests = hasher.map(_sha256, chunks)
            self._write_chunks(chunk_keys, chunks)
            chunk_sha256 = [d.hex() for d in digests]
        floats = {_dtype_name(t.dtype) for t in state.values() if t.is_floating_point()}
        manifest: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "run_id": self.run_id,
            "version": version,
            "kind": "delta" if delta else "full",
            "keyframe": base.keyframe if delta and base is not None else version,
            "weights_sha256": digest,
            "dtype": floats.pop() if len(floats) == 1 else ("mixed" if floats else "none"),
            "tensors": spec,
            "num_chunks": len(chunks),
            "chunk_sha256": chunk_sha256,
            "chunks_sha256": _digest_of_digests(chunk_sha256),
            "total_bytes": len(data),
            "meta": dict(meta or {}),
            "created_at": time.time(),
        }
        if delta and base is not None:
            manifest |= {"base": base.version, "base_sha256": base.digest, "encoding": encoding}
        self._commit(version, json.dumps(manifest), chunk_keys)
        self.last_publish_bytes = len(data)
        kept = state
        if self.keyframe_every > 1 and snapshot:
            kept = {name: t.clone() for name, t in state.items()}
        self._published = (
            _Held(version, digest, kept, manifest["keyframe"]) if self.keyframe_every > 1 else None
        )
        self._prune()

    def _write_chunks(self, keys: list[str], chunks: list[memoryview]) -> None:
        # Chunks expire unless the commit makes them permanent: a crash here leaves no garbage.
        pipe = self.client.pipeline(transaction=False)
        for key, chunk in zip(keys, chunks, strict=True):
            pipe.set(key, chunk, ex=self.pending_ttl_s)
        pipe.execute()

    def _commit(self, version: int, manifest_json: str, chunk_keys: list[str]) -> None:
        keys = [
            weights_latest_key(self.run_id),
            weights_versions_key(self.run_id),
            weights_manifest_key(self.run_id, version),
            *chunk_keys,
        ]
        args = [version, manifest_json, weights_channel(self.run_id)]
        status, detail = self._commit_script(keys=keys, args=args)
        if status == 1:
            logger.info(
                "published weights %s v%d (%d chunks)", self.run_id, version, len(chunk_keys)
            )
            return
        if status == 0:
            # Another writer got ahead between our check and the commit. Our chunks may have
            # overwritten a retained version's, whose checksums now catch that on fetch.
            raise WeightsError(
                f"refusing to publish version {version} for run {self.run_id!r}: latest moved "
                f"to {int(detail)} meanwhile (two writers?)"
            )
        raise WeightsError(
            f"chunk {detail.decode()} of version {version} expired before commit; the write took "
            f"longer than pending_ttl_s={self.pending_ttl_s}"
        )

    def _keep_from(self) -> int | None:
        """The oldest version to keep: the newest ``retention`` versions and the delta chain they
        need (from the keyframe of the oldest of them on), fewer while what is kept would hold
        more than ``retention_bytes``; the latest and its chain are always kept."""
        versions_key = weights_versions_key(self.run_id)
        window = [int(v) for v in self.client.zrange(versions_key, -self.retention, -1)]
        # Each manifest is read once: the window's for their keyframes, and, only with a byte
        # bound, every stored version's for its size.
        stored = window
        if self.retention_bytes:
            stored = [int(v) for v in self.client.zrangebyscore(versions_key, "-inf", "+inf")]
        manifests = {v: self.manifest(v) or {} for v in stored}
        keep_from = None
        for oldest in reversed(window):
            keyframe = manifests[oldest].get("keyframe")
            start = min(oldest, keyframe) if isinstance(keyframe, int) else oldest
            if keep_from is not None and self.retention_bytes:
                held = sum(int(m.get("total_bytes", 0)) for v, m in manifests.items() if v >= start)
                if held > self.retention_bytes:
                    break
            keep_from = start
        return keep_from

    def _prune(self) -> None:
        """Delete every version older than :meth:`_keep_from` says to keep."""
        versions_key = weights_versions_key(self.run_id)
        keep_from = self._keep_from()
        if keep_from is None:
            return
        old = self.client.zrangebyscore(versions_key, "-inf", f"({keep_from}")
        for raw in old:
            version = int(raw)
            keys = [weights_manifest_key(self.run_id, version)]
            manifest = self.manifest(version)
            if manifest is not None:
                keys += [
                    weights_chunk_key(self.run_id, version, i)
                    for i in range(int(manifest["num_chunks"]))
                ]
            # One transaction: a concurrent reader sees the whole version or none of it.
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(*keys)
            pipe.zrem(versions_key, raw)
            pipe.execute()
            logger.debug("pruned weights %s v%d", self.run_id, version)

    # --------------------------------------------------------------------------------- fetch

    def latest_version(self) -> int | None:
        raw = self.client.get(weights_latest_key(self.run_id))
        return int(raw) if raw is not None else None

    def manifest(self, version: int) -> dict[str, Any] | None:
        """The parsed manifest of ``version``, or None if it does not exist (or was pruned)."""
        raw = self.client.get(weights_manifest_key(self.run_id, version))
        if raw is None:
            return None
        try:
            manifest = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsCorrupt(f"manifest of version {version} is not valid JSON: {e}") from e
        if not isinstance(manifest, dict):
            raise WeightsCorrupt(f"manifest of version {version} is not a JSON object")
        return manifest

    def fetch(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, state_dict)`` of ``version`` (None: the latest), verified end to end.

        A full version's tensors are views into one buffer holding its bytes (no copy after the
        socket read); a delta is applied to the version this store fetched last when it is the
        delta's base, else to the chain from its keyframe, and the result must match the
        manifest's ``weights_sha256``. Non-finite floats are refused (``WeightsNonFinite``).
        With a host cache, one process per host reads from Redis and the others map its copy.
        ``load_state_dict`` copies the tensors into a model as usual; do not modify them in
        place (they are the base of the next delta, and a shared mapping).
        """
        if version is None:
            version = self.latest_version()
            if version is None:
                raise WeightsError(f"no weights published yet for run {self.run_id!r}")
        manifest = self._checked_manifest(version)
        digest = manifest["weights_sha256"]
        held = self._fetched
        if held is not None and held.version == version and held.digest == digest:
            return version, held.state
        cache = self.host_cache
        state = self._from_host_cache(version, manifest) if cache is not None else None
        if state is None:
            lock = cache.lock(self.run_id, version) if cache is not None else None
            with lock if lock is not None else contextlib.nullcontext():
                # Another process of this host may have fetched it while we waited.
                state = self._from_host_cache(version, manifest) if cache is not None else None
                if state is None:
                    state, raw = self._build(version, manifest)
                    if cache is not None:
                        cache.put(self.run_id, version, digest, raw)
        self._fetched = _Held(version, digest, state, int(manifest["keyframe"]))
        return version, state

    def _checked_manifest(self, version: int) -> dict[str, Any]:
        manifest = self.manifest(version)
        if manifest is None:
            raise WeightsError(f"weights version {version} of run {self.run_id!r} not found")
        if manifest.get("format") != MANIFEST_FORMAT:
            raise WeightsError(
                f"weights version {version} of run {self.run_id!r} has manifest format "
                f"{manifest.get('format')!r}; this reader reads format {MANIFEST_FORMAT}"
            )
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

    def _from_host_cache(
        self, version: int, manifest: Mapping[str, Any]
    ) -> dict[str, torch.Tensor] | None:
        assert self.host_cache is not None
        buf = self.host_cache.get(self.run_id, version, manifest["weights_sha256"])
        if buf is None:
            return None
        # Written only after this host's fetcher verified it: check the layout, not the bytes.
        state = _tensors_from_safetensors(version, buf)
        _check_against_manifest(version, state, manifest["tensors"])
        return {name: state[name] for name in manifest["tensors"]}

    def _build(
        self, version: int, manifest: Mapping[str, Any]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | bytes]:
        """The full state of ``version`` from Redis, and its safetensors bytes (for the host
        cache): a full read, or the deltas since a version we hold (or since the keyframe)."""
        chain = [(version, manifest)]
        held = self._fetched
        while chain[-1][1]["kind"] == "delta":
            v, m = chain[-1]
            if held is not None and held.version == m["base"] and held.digest == m["base_sha256"]:
                break
            base = self._checked_manifest(m["base"]) if m["base"] < v else None
            if base is None or base["weights_sha256"] != m["base_sha256"]:
                raise WeightsCorrupt(f"version {v}: its base {m['base']} is not the one it names")
            if self.host_cache is not None:
                cached = self._from_host_cache(m["base"], base)
                if cached is not None:  # another process of this host built the base already
                    held = _Held(m["base"], base["weights_sha256"], cached, base["keyframe"])
                    break
            chain.append((m["base"], base))
        chain.reverse()
        first_version, first = chain[0]
        if first["kind"] == "full":
            buf = self._read_manifest_bytes(first_version, first)
            state = _tensors_from_safetensors(first_version, buf)
            _check_against_manifest(first_version, state, first["tensors"])
            state = {name: state[name] for name in first["tensors"]}
            check_finite(first_version, state)
            raw: torch.Tensor | bytes = buf
            chain = chain[1:]
        else:
            assert held is not None
            state = held.state
        for v, m in chain:
            blob = _tensors_from_safetensors(v, self._read_manifest_bytes(v, m))
            state = apply_delta(v, state, blob, m["encoding"])
            _check_against_manifest(v, state, m["tensors"])
            check_finite(v, state)
            got = weights_digest(state)
            if got != m["weights_sha256"]:
                raise WeightsCorrupt(
                    f"version {v}: weights after applying the delta hash to {got[:12]}…, "
                    f"manifest weights_sha256 says {m['weights_sha256'][:12]}…"
                )
        if manifest["kind"] == "delta":
            raw = serialize_state_dict(state) if self.host_cache is not None else b""
        return state, raw

    def _read_manifest_bytes(self, version: int, manifest: Mapping[str, Any]) -> torch.Tensor:
        """The verified bytes of one stored version (a full version's or a delta's)."""
        try:
            num_chunks = int(manifest["num_chunks"])
            chunk_sha256 = [str(h) for h in manifest["chunk_sha256"]]
            chunks_sha256 = str(manifest["chunks_sha256"])
            total_bytes = int(manifest["total_bytes"])
            listed = _digest_of_digests(chunk_sha256)
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
        buf = _new_buffer(total_bytes)
        self._read_verified(version, chunk_sha256, buf)
        return buf

    def _read_verified(self, version: int, chunk_sha256: list[str], buf: torch.Tensor) -> None:
        """Fill ``buf`` with the chunks of ``version``, each checked against its sha256."""
        out = memoryview(buf.numpy())
        num_chunks = len(chunk_sha256)
        keys = [weights_chunk_key(self.run_id, version, i) for i in range(num_chunks)]
        filled = 0
        # Hash each chunk on a helper thread (hashlib releases the GIL) while the next arrives.
        with ThreadPoolExecutor(1, thread_name_prefix="weights-sha256") as hasher:
            digests: list[Future[bytes]] = []
            chunks = self._stream_chunks(version, keys, out)
            try:
                for i, view in enumerate(chunks):
                    if view is None:
                        if self.manifest(version) is None:
                            raise WeightsError(f"weights version {version} expired while fetching")
                        raise WeightsCorrupt(
                            f"version {version}: chunk {i}/{num_chunks} is missing"
                        )
                    digests.append(hasher.submit(_sha256, view))
                    filled += len(view)
            finally:
                chunks.close()  # releases the connection at once, also on an error
            for i, (digest, want) in enumerate(zip(digests, chunk_sha256, strict=True)):
                got = digest.result().hex()
                if got != want:
                    raise WeightsCorrupt(
                        f"version {version}: chunk {i} sha256 {got[:12]}… != manifest {want[:12]}…"
                    )
        if filled != len(out):
            raise WeightsCorrupt(
                f"version {version}: {filled} bytes do not match the manifest total "
                f"({len(out)} bytes)"
            )

    def _stream_chunks(
        self, version: int, keys: list[str], out: memoryview
    ) -> Iterator[memoryview | None]:
        """Each chunk's bytes placed in ``out`` one after the other, as a view of where it
        landed; None for a missing chunk (and nothing after it)."""
        conn = self._raw_connection()
        if conn is None:
            yield from self._pipelined_chunks(version, keys, out)
            return
        try:
            yield from _stream_gets(conn, keys, out, lambda: _overflow(version, len(out)))
        finally:
            conn.disconnect()

    def _raw_connection(self) -> redis.connection.AbstractConnection | None:
        """A fresh connection of the client's kind whose socket we may read directly, or None
        where that is not a plain socket (client-side caching, sentinel, cluster...)."""
        pool = self.client.connection_pool
        kwargs = getattr(pool, "connection_kwargs", None)
        if (
            getattr(pool, "connection_class", None) not in _RAW_CONNECTION_CLASSES
            or kwargs is None
            or getattr(pool, "cache", None) is not None
        ):
            return None
        conn = pool.connection_class(**kwargs)
        conn.connect()  # connect, AUTH, SELECT: all replies read before we touch the socket
        if not isinstance(getattr(conn, "_sock", None), socket.socket):
            conn.disconnect()
            return None
        return conn

    def _pipelined_chunks(
        self, version: int, keys: list[str], out: memoryview
    ) -> Iterator[memoryview | None]:
        """The same through redis-py's parser (its own copies; slower, any client kind)."""
        pos = 0
        for start in range(0, len(keys), _FALLBACK_BATCH):
            pipe = self.client.pipeline(transaction=False)
            for key in keys[start : start + _FALLBACK_BATCH]:
                pipe.get(key)
            for chunk in pipe.execute():
                if chunk is None:
                    yield None
                    return
                if len(chunk) > len(out) - pos:
                    raise _overflow(version, len(out))
                view = out[pos : pos + len(chunk)]
                view[:] = chunk
                pos += len(chunk)
                yield view

    def watch(self, last_seen: int | None = None, poll_interval_s: float = 1.0) -> VersionWatcher:
        """A watcher that reports versions newer than ``last_seen`` (None: any version)."""
        return VersionWatcher(self.client, self.run_id, last_seen, poll_interval_s)


_CONNECTION_ARGS = (
    "host",
    "port",
    "path",
    "db",
    "username",
    "password",
    "socket_timeout",
    "socket_connect_timeout",
    "socket_keepalive",
    "client_name",
    "health_check_interval",
)


def _portable_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of a connection pool that say where and how to connect (address, db,
    credentials, timeouts, TLS settings), with plain values only: the objects redis-py keeps
    among them (registries with locks, sentinels, handlers) belong to one pool, and a new pool
    makes its own."""
    plain = (str, int, float, bool, type(None))
    return {
        key: value
        for key, value in kwargs.items()
        if (key in _CONNECTION_ARGS or key.startswith("ssl_")) and isinstance(value, plain)
    }


_HUGE_PAGES_FROM = 8 * 2**20
"""Buffers at least this large ask for transparent huge pages (2 MiB on x86-64)."""

_MADV_POPULATE_WRITE = 23  # Linux's value; Python 3.11's mmap does not name it


def _new_buffer(nbytes: int) -> torch.Tensor:
    """Writable uint8 memory for one fetch, its pages mapped up front where the OS can, so the
    data does not land through a page fault per 4 KiB.

    Large buffers ask for transparent huge pages (``MADV_HUGEPAGE``) and then map them in one
    call (``MADV_POPULATE_WRITE``, Linux >= 5.14): for 100 MB about 5 ms instead of 27 ms with
    ``MAP_POPULATE`` of small pages, a fifth of a fetch's time. Where either advice is refused
    the pages are mapped as the data lands."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if nbytes == 0 or not populate:
        return torch.empty(nbytes, dtype=torch.uint8)
    anonymous = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    huge = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes >= _HUGE_PAGES_FROM and huge is not None:
        memory = mmap.mmap(-1, nbytes, flags=anonymous)
        with contextlib.suppress(OSError):
            memory.madvise(huge)
            memory.madvise(getattr(mmap, "MADV_POPULATE_WRITE", _MADV_POPULATE_WRITE))
    else:
        memory = mmap.mmap(-1, nbytes, flags=anonymous | populate)
    return torch.frombuffer(memory, dtype=torch.uint8)  # keeps ``memory`` alive


def _sha256(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def _digest_of_digests(chunk_sha256: list[str]) -> str:
    """sha256 over the concatenated chunk digests: one checksum for the whole version."""
    return hashlib.sha256(b"".join(bytes.fromhex(h) for h in chunk_sha256)).hexdigest()


def _overflow(version: int, total_bytes: int) -> WeightsCorrupt:
    return WeightsCorrupt(
        f"version {version}: the chunks hold more than the manifest total ({total_bytes} bytes)"
    )


_RAW_CONNECTION_CLASSES = (
    redis.connection.Connection,
    redis.connection.SSLConnection,
    redis.connection.UnixDomainSocketConnection,
)


class _RespReader:
    """RESP2/3 replies read off a raw socket: status lines through a small buffer, bulk payloads
    straight into the caller's memory (the kernel's copy is the only one)."""

    _RECV_BYTES = 4096

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()

    def _fill(self) -> None:
        data = self._sock.recv(self._RECV_BYTES)
        if not data:
            raise ConnectionError("Redis closed the connection in the middle of a reply")
        self._buf += data

    def readline(self) -> bytes:
        searched = 0
        while (end := self._buf.find(b"\r\n", searched)) < 0:
            if len(self._buf) > _MAX_RESP_LINE:
                raise redis.exceptions.InvalidResponse(f"no line end in {len(self._buf)} bytes")
            searched = max(0, len(self._buf) - 1)
            self._fill()
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

    def read_into(self, out: memoryview) -> None:
        take = min(len(out), len(self._buf))
        out[:take] = self._buf[:take]
        del self._buf[:take]
        while take < len(out):
            got = self._sock.recv_into(out[take:])
            if not got:
                raise ConnectionError("Redis closed the connection in the middle of a reply")
            take += got

    def skip_value(self, line: bytes) -> None:
        """Consume the rest of the RESP2/3 value whose first line is ``line``."""
        kind, count = line[:1], line[1:]
        if kind in b"$=!":  # bulk string, verbatim string, blob error ($-1: null)
            size = int(count)
            if size >= 0:
                while len(self._buf) < size + 2:
                    self._fill()
                del self._buf[: size + 2]
        elif kind in b"*>~%|":  # array, push, set (*-1: null); map and attribute: pairs
            items = int(count) * (2 if kind in b"%|" else 1)
            for _ in range(max(0, items)):
                self.skip_value(self.readline())

    def skip_crlf(self) -> None:
        while len(self._buf) < 2:
            self._fill()
        if self._buf[:2] != b"\r\n":
            raise redis.exceptions.InvalidResponse("bulk reply not followed by CRLF")
        del self._buf[:2]


def _stream_gets(
    conn: redis.connection.AbstractConnection,
    keys: list[str],
    out: memoryview,
    overflow: Callable[[], Exception],
) -> Iterator[memoryview | None]:
    """GET ``keys`` in order on ``conn``'s socket, ``_FETCH_WINDOW`` requests in flight, placing
    the values one after the other in ``out``; see ``WeightStore._stream_chunks``. The caller
    disconnects ``conn`` afterwards (replies may be left unread)."""
    sock: socket.socket = conn._sock  # type: ignore[attr-defined]
    reader = _RespReader(sock)
    requests = [b"".join(conn.pack_command("GET", key)) for key in keys]
    sent = 0
    pos = 0
    try:
        for i in range(len(keys)):
            ahead = min(len(keys), i + 1 + _FETCH_WINDOW)
            if ahead > sent:
                sock.sendall(b"".join(requests[sent:ahead]))
                sent = ahead
            line = reader.readline()
            while line[:1] in b">|":  # RESP3 push message or attribute: not our reply
                reader.skip_value(line)
                line = reader.readline()
            if line[:1] in b"-!":
                if line[:1] == b"!":  # RESP3 blob error
                    size = int(line[1:])
                    message = bytearray(size)
                    reader.read_into(memoryview(message))
                    reader.skip_crlf()
                    line = b"-" + bytes(message)
                raise redis.ResponseError(line[1:].decode("utf-8", errors="replace"))
            if line == b"_":  # RESP3 null: no such key
                yield None
                return
            try:
                if line[:1] != b"$":
                    raise ValueError(line[:1])
                size = int(line[1:])
            except ValueError as e:
                raise redis.exceptions.InvalidResponse(
                    f"unexpected reply to GET: {line[:40]!r}"
                ) from e
            if size < 0:  # RESP2 null ($-1): no such key
                yield None
                return
            if size > len(out) - pos:
                raise overflow()
            view = out[pos : pos + size]
            reader.read_into(view)
            reader.skip_crlf()
            pos += size
            yield view
    except TimeoutError as e:  # socket.timeout
        raise redis.TimeoutError(f"timeout reading weight chunks: {e}") from e
    except OSError as e:  # includes the ConnectionErrors raised above
        raise redis.ConnectionError(f"error reading weight chunks: {e}") from e


def _tensors_from_safetensors(version: int, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors over ``buf`` (uint8, safetensors bytes) without copying: views of its storage.

    A tensor whose offset is not aligned to its element size (safetensors does not promise it)
    is copied; a dtype this module does not know goes through ``safetensors.torch.load``.
    """
    raw = buf.numpy()
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
    base = 8 + header_len
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name = spec["dtype"]
            shape = [int(d) for d in spec["shape"]]
            begin, end = (int(o) for o in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsCorrupt(f"version {version}: safetensors entry {name!r}: {e!r}") from e
        dtype = _SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            try:
                return safetensors.torch.load(raw.tobytes())
            except SafetensorError as e:
                raise WeightsCorrupt(f"version {version}: safetensors cannot parse: {e}") from e
        if (
            any(d < 0 for d in shape)
            or not 0 <= begin <= end <= total - base
            or end - begin != math.prod(shape) * dtype.itemsize
        ):
            raise WeightsCorrupt(
                f"version {version}: safetensors entry {name!r} ({dtype_name}, {shape}) does "
                f"not fit its bytes [{begin}, {end})"
            )
        flat = buf[base + begin : base + end]
        if (base + begin) % dtype.itemsize:
            flat = flat.clone()
        tensors[name] = flat.view(dtype).view(shape)
    return tensors


def _check_against_manifest(
    version: int, state_dict: Mapping[str, torch.Tensor], expected: Mapping[str, Mapping[str, Any]]
) -> None:
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
        if _dtype_name(tensor.dtype) != spec.get("dtype"):
            raise WeightsCorrupt(
                f"version {version}: {name} has dtype {_dtype_name(tensor.dtype)}, manifest says "
                f"{spec.get('dtype')}"
            )


class VersionWatcher:
    """Notices new versions: pub/sub subscription, with polling of `latest` as a fallback (a missed
    message or a Redis restart must not leave an actor behind)."""

    _MAX_BACKOFF_S = 5.0

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        last_seen: int | None = None,
        poll_interval_s: float = 1.0,
    ) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.client = client
        self.run_id = run_id
        self.last_seen = last_seen
        self.poll_interval_s = poll_interval_s
        self._pubsub: redis.client.PubSub | None = None
        self._next_check = 0.0  # monotonic time of the next GET of `latest`
        self._backoff_s = 0.1

    def _is_new(self, version: int | None) -> bool:
        return version is not None and (self.last_seen is None or version > self.last_seen)

    def _subscribe(self) -> redis.client.PubSub:
        if self._pubsub is None:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(weights_channel(self.run_id))
            self._pubsub = pubsub
            # Check `latest` right after subscribing: a version announced before the
            # subscription took effect is then found by the GET, anything later by the message.
            self._next_check = 0.0
        return self._pubsub

    def _latest(self) -> int | None:
        raw = self.client.get(weights_latest_key(self.run_id))
        return int(raw) if raw is not None else None

    def poll(self, timeout_s: float) -> int | None:
        """The newest version > last seen (and remember it), or None after ``timeout_s``.

        Never raises on a lost connection: it logs, backs off and returns None, so the actor keeps
        generating with its current weights; the next call resubscribes.
        """
        deadline = time.monotonic() + timeout_s
        try:
            pubsub = self._subscribe()
            while True:
                now = time.monotonic()
                if now >= self._next_check:
                    self._next_check = now + self.poll_interval_s
                    latest = self._latest()
                    if self._is_new(latest):
                        return self._advance(latest)
                wait_s = min(deadline, self._next_check) - time.monotonic()
                message = pubsub.get_message(timeout=max(0.0, wait_s))
                if message is not None and message["type"] == "message":
                    # The message only wakes us; `latest` is the truth and may be newer still.
                    announced = int(message["data"])
                    latest = self._latest()
                    newest = max(announced, latest) if latest is not None else announced
                    if self._is_new(newest):
                        return self._advance(newest)
                if time.monotonic() >= deadline:
                    self._backoff_s = 0.1  # Redis answered: the next outage starts from scratch
                    return None
        except redis.ConnectionError as e:
            logger.warning(
                "weights watcher for run %r lost Redis (%s); retrying in %.1f s",
                self.run_id,
                e,
                self._backoff_s,
            )
            self._drop_subscription()
            time.sleep(max(0.0, min(self._backoff_s, deadline - time.monotonic())))
            self._backoff_s = min(self._backoff_s * 2, self._MAX_BACKOFF_S)
            return None

    def _advance(self, version: int) -> int:
        self.last_seen = version
        self._backoff_s = 0.1
        return version

    def _drop_subscription(self) -> None:
        if self._pubsub is not None:
            pubsub, self._pubsub = self._pubsub, None
            try:
                pubsub.close()
            except redis.ConnectionError as e:  # already broken; nothing else to release
                logger.debug("closing a broken pubsub: %s", e)

    def close(self) -> None:
        self._drop_subscription()

    def __enter__(self) -> VersionWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
"""What a Redis restart or outage raises in redis-py."""


def retry_redis(who: str, what: str, action, should_stop, max_backoff_s: float = 5.0):
    """``action()``, retried with backoff while Redis is unreachable (a Redis restart must not
    kill a learner or an actor); None if a stop has come when an attempt fails."""
    backoff_s = 0.1
    while True:
        try:
            return action()
        except REDIS_DOWN as e:
            if should_stop():
                return None
            logger.warning(
                "%s: %s: Redis unreachable (%s); retrying in %.1f s", who, what, e, backoff_s
            )
            time.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, max_backoff_s)


def store_from_config(cfg: RedisConfig, run_id: str) -> WeightStore:
    """The run's weight store on the configured Redis (learner and actors build it the same way)."""
    return WeightStore(
        redis.Redis.from_url(cfg.resolved_url()),
        run_id,
        chunk_bytes=cfg.chunk_bytes,
        retention=cfg.retention,
        retention_bytes=cfg.retention_bytes,
        keyframe_every=cfg.keyframe_every,
        host_cache=HostCache(cfg.host_cache_dir) if cfg.host_cache_dir else None,
    )

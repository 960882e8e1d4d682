"""The learner's side of the weight store (docs/design.md §6.1, §6.3): ``WeightWriter`` publishes
a version (its chunks, then one atomic commit) and prunes what retention no longer keeps;
``encode_delta`` writes the sparse, bit-exact deltas common/weights/deltas.py applies.

With ``keyframe_every > 1`` a version is a delta against the one this writer published before,
while that is still the latest. A version with a non-finite floating tensor is refused before
anything is written. With the node-local plane (``redis.publish_to_host_cache``,
common/weights/publish/node_plane.py) a version goes into the node's weights cache first and is
committed before its Redis bytes, which follow for other nodes (docs/design.md §6.5).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Self

import redis
import safetensors.torch
import torch

from common.config.run import RedisConfig
from common.weights.deltas import DENSE, IDX, VAL, apply_delta
from common.weights.format import (
    WeightsError,
    check_finite,
    dtype_name,
    publish_threads,
    safetensors_chunks,
    threaded_map,
    weights_digest,
)
from common.weights.host_cache import HostCache
from common.weights.keys import (
    weights_channel,
    weights_chunk_key,
    weights_latest_key,
    weights_manifest_key,
    weights_versions_key,
)
from common.weights.manifest import MANIFEST_FORMAT, digest_of_digests, sha256_of
from common.weights.publish.node_plane import NodePlane
from common.weights.publish.retention import prune
from common.weights.store import HeldVersion, WeightStore

logger = logging.getLogger(__name__)

# A delta larger than this fraction of the full weights is written as a full version instead.
_MAX_DELTA_FRACTION = 0.5

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


FLUSH_BYTES = 64 * 2**20
"""Bytes of chunks at which the writer sends those waiting for Redis (one pipeline round trip,
then released), and waits for the oldest of those waiting to be hashed."""


def write_chunks(
    client: redis.Redis,
    run_id: str,
    version: int,
    data: bytes | bytearray | Iterable[bytes | bytearray],
    size: int,
    ttl_s: int,
    threads: int = 1,
) -> tuple[list[str], list[str]]:
    """Write ``data`` as the ``size``-byte chunks of ``version`` (or ``data`` already cut into
    those chunks, made as they are taken: see ``safetensors_chunks``), each expiring after
    ``ttl_s`` unless a commit makes it permanent (a writer that dies here leaves no garbage);
    their keys and sha256s. The chunks waiting for Redis and those waiting to be hashed each
    stay under ``FLUSH_BYTES`` plus one chunk: once either reaches ``FLUSH_BYTES``, the writer
    sends the pipeline, or waits for the oldest digests."""
    if isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data)
        data = [view[i : i + size] for i in range(0, len(view), size)]
    keys: list[str] = []
    # Hash on ``threads`` helper threads (hashlib releases the GIL) while the chunks go out; the
    # digests are only needed by the manifest, which is written last.
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="weights-sha256") as hasher:
        digests: list[Future[bytes]] = []
        hashing: deque[tuple[Future[bytes], int]] = deque()  # submitted, not waited for
        pipe, waiting, queued = client.pipeline(transaction=False), 0, 0
        for index, chunk in enumerate(data):
            keys.append(weights_chunk_key(run_id, version, index))
            digests.append(hasher.submit(sha256_of, chunk))
            hashing.append((digests[-1], len(chunk)))
            queued += len(chunk)
            while queued >= FLUSH_BYTES:  # hashing fell behind: take no chunk until it catches up
                oldest, n = hashing.popleft()
                oldest.result()
                queued -= n
            pipe.set(keys[-1], chunk, ex=ttl_s)
            waiting += len(chunk)
            if waiting >= FLUSH_BYTES:
                pipe.execute()
                pipe, waiting = client.pipeline(transaction=False), 0
        pipe.execute()
        return keys, [d.result().hex() for d in digests]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat as same-width integers: compares bits (NaN, -0.0) rather than values."""
    flat = t.reshape(-1)
    by_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    size = t.element_size()
    return flat.view(by_size[size]) if size in by_size else flat


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
            blob[IDX + name] = changed.to(index_dtype)
            blob[VAL + name] = t.reshape(-1)[changed]
            encoding[name] = "sparse"
        else:
            blob[DENSE + name] = t.contiguous()
            encoding[name] = "dense"
    return blob, encoding


def delta_bytes(
    base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> tuple[bytes, dict[str, str], dict[str, torch.Tensor]] | None:
    """The safetensors bytes of the delta from ``base`` to ``new``, its encoding and its blob
    (``encode_delta``'s tensors), or None
    where it would not save enough: a delta that saves little (every element moved, as with
    fp32 weights) costs a digest check on every reader and lengthens the chain Redis keeps."""
    blob, encoding = encode_delta(base, new)
    data = safetensors.torch.save(blob)
    full_bytes = sum(t.numel() * t.element_size() for t in new.values())
    if len(data) > _MAX_DELTA_FRACTION * full_bytes:
        return None
    return data, encoding, blob


def _layout(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {n: (t.shape, t.dtype) for n, t in state.items()}


def new_manifest(
    run_id: str,
    version: int,
    state: Mapping[str, torch.Tensor],
    digest: str,
    keyframe: int,
    chunk_sha256: list[str],
    total_bytes: int,
    meta: Mapping[str, str | int | float] | None,
) -> dict[str, Any]:
    """The manifest of a full version (a delta's adds ``base``, ``base_sha256``, ``encoding``
    and its ``kind``)."""
    floats = {dtype_name(t.dtype) for t in state.values() if t.is_floating_point()}
    return {
        "format": MANIFEST_FORMAT,
        "run_id": run_id,
        "version": version,
        "kind": "full",
        "keyframe": keyframe,
        "weights_sha256": digest,
        "dtype": floats.pop() if len(floats) == 1 else ("mixed" if floats else "none"),
        "tensors": {
            name: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}
            for name, t in state.items()
        },
        "num_chunks": len(chunk_sha256),
        "chunk_sha256": chunk_sha256,
        "chunks_sha256": digest_of_digests(chunk_sha256),
        "total_bytes": total_bytes,
        "meta": dict(meta or {}),
        "created_at": time.time(),
    }


@dataclass
class _Pending:
    """A version committed before its Redis bytes (the node-local plane): what storing them
    needs, kept so a retry after a Redis outage stores them instead of publishing again."""

    version: int
    digest: str
    state: dict[str, torch.Tensor]
    base: HeldVersion | None
    snapshot: bool


class WeightWriter(WeightStore):
    """Publishes versions of a state dict for one run; remembers the last version it published
    (the base of the next delta), so a process uses one writer per run. Given a ``node_plane``,
    a version is first written into the node's shared-memory cache for the actors there, then
    committed, then its Redis bytes follow (common/weights/publish/node_plane.py)."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        host_cache_dir: str = "",
        **settings: int,
    ) -> None:
        """``host_cache_dir``: the node-local plane into that host cache (empty: off)."""
        super().__init__(client, run_id, **settings)
        self._commit_script = client.register_script(_COMMIT_LUA)
        self._published: HeldVersion | None = None  # base of the next delta we write
        self._owned = False  # whether ``_published``'s tensors are this writer's own copy
        self._pending: _Pending | None = None
        self.node_plane = (
            NodePlane(client, run_id, HostCache(host_cache_dir)) if host_cache_dir else None
        )
        self.last_publish_bytes = 0
        """Bytes written to Redis for the last published version (a delta's, or the full
        size)."""
        self.threads = publish_threads()
        """Threads checking, hashing and writing a version (the cores here, at most 16); the
        upload process runs at a lower priority than the learner's threads. A full version is
        serialised chunk by chunk on the writing thread, as its chunks go out
        (``safetensors_chunks``)."""

    @classmethod
    def from_config(cls, cfg: RedisConfig, run_id: str) -> Self:
        """The run's writer on the configured Redis, with the node-local plane where
        ``redis.publish_to_host_cache`` and ``redis.host_cache_dir`` are set."""
        writer = super().from_config(cfg, run_id)
        if cfg.publish_to_host_cache and cfg.host_cache_dir:
            writer.node_plane = NodePlane(writer.client, run_id, HostCache(cfg.host_cache_dir))
        return writer

    def recipe(self) -> dict[str, Any]:
        """:meth:`WeightStore.recipe`, with the node-local plane's directory."""
        root = self.node_plane.root if self.node_plane is not None else ""
        return {**super().recipe(), "host_cache_dir": root}

    @classmethod
    def from_recipe(cls, recipe: Mapping[str, Any]) -> Self:
        writer = super().from_recipe(recipe)
        root = recipe.get("host_cache_dir", "")
        if root:
            writer.node_plane = NodePlane(writer.client, writer.run_id, HostCache(root))
        return writer

    def publish(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        meta: Mapping[str, str | int | float] | None = None,
        snapshot: bool = True,
    ) -> None:
        """Write ``version`` and make it the latest; raises ``WeightsError`` unless it is newer,
        ``WeightsNonFinite`` (writing nothing) if a floating tensor holds NaN or infinity.

        With ``keyframe_every > 1`` the writer keeps the published tensors as the next delta's
        base: its own copy when ``snapshot`` (False: the caller hands them over and will not
        modify them), updated in place from the next version's delta. A call after a Redis
        outage interrupted the storing of a version committed before its bytes stores them.
        """
        pending, self._pending = self._pending, None
        if pending is not None and pending.version == version and self._store_pending(pending):
            return  # else Redis lost the commit too (restarted empty): published anew below
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise WeightsError(f"version must be a non-negative int, got {version!r}")
        current = self.latest_version()
        if current is not None and version <= current:
            raise WeightsError(
                f"refusing to publish version {version} for run {self.run_id!r}: latest is "
                f"{current} and versions only grow"
            )
        state = {name: t.detach().to("cpu").contiguous() for name, t in state_dict.items()}
        check_finite(version, state, self.threads)
        digest = weights_digest(state, threads=self.threads)
        base = self._delta_base(version, current, state)
        planes = None
        if self.node_plane is not None:
            planes = self.node_plane.put(version, digest, state, self.threads)
        if planes is not None:
            manifest = new_manifest(self.run_id, version, state, digest, version, [], 0, meta)
            for field in ("num_chunks", "chunk_sha256", "chunks_sha256", "total_bytes"):
                del manifest[field]
            manifest |= {"planes": planes, "redis_bytes": "pending"}
            self._commit(version, json.dumps(manifest), [])
            self._store_pending(_Pending(version, digest, state, base, snapshot))
            return
        fields, chunk_keys, blob = self._write_bytes(version, state, base)
        manifest = new_manifest(
            self.run_id, version, state, digest, fields["keyframe"], [], 0, meta
        )
        self._commit(version, json.dumps(manifest | fields), chunk_keys)
        self._keep(version, digest, state, fields, blob, snapshot)

    def _store_pending(self, pending: _Pending) -> bool:
        """Write the Redis bytes of a version committed before them, then its bytes record;
        False where its manifest is gone (nothing kept). Until then the version stays pending:
        a retry of the same version (after a Redis outage here) stores its bytes."""
        assert self.node_plane is not None
        self._pending = pending
        fields, chunk_keys, blob = self._write_bytes(pending.version, pending.state, pending.base)
        stored = self.node_plane.store_bytes(pending.version, fields, chunk_keys)
        self._pending = None
        if stored:
            self._keep(
                pending.version, pending.digest, pending.state, fields, blob, pending.snapshot
            )
        return stored

    def _write_bytes(
        self, version: int, state: dict[str, torch.Tensor], base: HeldVersion | None
    ) -> tuple[dict[str, Any], list[str], dict[str, torch.Tensor] | None]:
        """Write ``version``'s chunks (a delta against ``base`` where one saves enough, else
        in full); the manifest fields that describe them, their keys, and the delta's blob."""
        delta = delta_bytes(base.state, state) if base is not None else None
        settings = self.settings
        if delta is not None:
            data, encoding, blob = delta
            total = len(data)
        else:  # in full, serialised chunk by chunk as the chunks go out
            base, blob, encoding = None, None, {}
            total, data = safetensors_chunks(state, settings.chunk_bytes)
        chunk_keys, chunk_sha256 = write_chunks(
            self.client,
            self.run_id,
            version,
            data,
            settings.chunk_bytes,
            settings.pending_ttl_s,
            self.threads,
        )
        fields: dict[str, Any] = {
            "kind": "full",
            "keyframe": base.keyframe if base is not None else version,
            "num_chunks": len(chunk_sha256),
            "chunk_sha256": chunk_sha256,
            "chunks_sha256": digest_of_digests(chunk_sha256),
            "total_bytes": total,
        }
        if base is not None:
            fields |= {
                "kind": "delta",
                "base": base.version,
                "base_sha256": base.digest,
                "encoding": encoding,
            }
        self.last_publish_bytes = total
        return fields, chunk_keys, blob

    def _keep(
        self,
        version: int,
        digest: str,
        state: dict[str, torch.Tensor],
        fields: Mapping[str, Any],
        blob: dict[str, torch.Tensor] | None,
        snapshot: bool,
    ) -> None:
        """Remember ``version`` as the next delta's base (``keyframe_every > 1``), then prune.

        With ``snapshot`` the writer keeps its own copy: the base it already owns is updated in
        place (a delta's changed elements written in, a full version copied over it), so a
        version costs no new copy of the weights; a first version is cloned."""
        if self.settings.keyframe_every == 1:
            self._published = None
            self._prune()
            return
        owned = self._published if self._owned else None
        if owned is not None and _layout(owned.state) != _layout(state):
            owned = None
        self._owned = snapshot
        if not snapshot:
            kept = state
        elif owned is not None and blob is not None and owned.version == fields.get("base"):
            kept = apply_delta(version, owned.state, blob, fields["encoding"], in_place=True)
        elif owned is not None:
            kept = owned.state
            threaded_map(lambda name: kept[name].copy_(state[name]), list(state), self.threads)
        else:
            kept = {name: t.clone() for name, t in state.items()}
        self._published = HeldVersion(version, digest, kept, int(fields["keyframe"]))
        self._prune()

    def _delta_base(
        self, version: int, current: int | None, state: Mapping[str, torch.Tensor]
    ) -> HeldVersion | None:
        """What ``version`` may be a delta against: the version this writer published last,
        while it is still the latest, the chain since its keyframe is shorter than
        ``keyframe_every``, and it has the same tensors."""
        base = self._published
        if (
            self.settings.keyframe_every == 1
            or base is None
            or base.version != current
            or version - base.keyframe >= self.settings.keyframe_every
        ):
            return None
        return base if _layout(base.state) == _layout(state) else None

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
            f"longer than pending_ttl_s={self.settings.pending_ttl_s}"
        )

    def _prune(self) -> None:
        settings = self.settings
        prune(self.client, self.run_id, settings.retention, settings.retention_bytes, self.manifest)

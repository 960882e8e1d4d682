"""The Redis weight store (DESIGN §5): versioned, chunked, checksummed safetensors bytes.

Write order is the whole consistency story:

1. chunks of one version (each with a TTL, so a writer that dies here leaves no garbage);
2. one atomic Lua commit that checks every chunk is present, makes the chunks permanent, writes
   the manifest, moves ``latest`` forward only, adds the version to the versions zset and
   announces it on the channel.

So a reader that follows ``latest`` (or any manifest) only ever sees complete versions, and
``latest`` never goes backwards even with two writers. Retention deletes a whole version (manifest
and chunks) in one transaction, and readers read all chunks in one transaction, so a version
pruned mid-fetch reads as *expired* (``WeightsError``), never as a torn mix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import redis
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

logger = logging.getLogger(__name__)

MANIFEST_FORMAT = 1

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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # "float32", "bfloat16", "int64"


def serialize_state_dict(state_dict: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes of ``state_dict`` as contiguous CPU tensors.

    Tensors that share storage (tied embedding / LM head) are cloned, because safetensors refuses
    shared storage; the reader gets independent copies, which ``load_state_dict`` handles.
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
    return safetensors.torch.save(tensors)


class WeightStore:
    """Publishes and fetches versions of a state dict for one run."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        chunk_bytes: int = 8 * 2**20,
        retention: int = 3,
        pending_ttl_s: int = 600,
    ) -> None:
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("WeightStore needs a redis client with decode_responses=False")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        if retention < 1:
            raise ValueError(f"retention must be >= 1 (the latest is always kept), got {retention}")
        if pending_ttl_s <= 0:
            raise ValueError(f"pending_ttl_s must be > 0, got {pending_ttl_s}")
        self.client = client
        self.run_id = run_id
        self.chunk_bytes = chunk_bytes
        self.retention = retention
        self.pending_ttl_s = pending_ttl_s
        self._commit_script = client.register_script(_COMMIT_LUA)

    # ------------------------------------------------------------------------------- publish

    def publish(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        meta: Mapping[str, str | int | float] | None = None,
    ) -> None:
        """Write ``version`` and make it the latest; raises ``WeightsError`` unless it is newer."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise WeightsError(f"version must be a non-negative int, got {version!r}")
        current = self.latest_version()
        if current is not None and version <= current:
            raise WeightsError(
                f"refusing to publish version {version} for run {self.run_id!r}: latest is "
                f"{current} and versions only grow"
            )
        data = serialize_state_dict(state_dict)
        view = memoryview(data)
        chunks = [view[i : i + self.chunk_bytes] for i in range(0, len(data), self.chunk_bytes)]
        chunk_keys = [weights_chunk_key(self.run_id, version, i) for i in range(len(chunks))]
        manifest = {
            "format": MANIFEST_FORMAT,
            "run_id": self.run_id,
            "version": version,
            "tensors": {
                name: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
                for name, t in state_dict.items()
            },
            "num_chunks": len(chunks),
            "chunk_sha256": [hashlib.sha256(c).hexdigest() for c in chunks],
            "sha256": hashlib.sha256(data).hexdigest(),
            "total_bytes": len(data),
            "meta": dict(meta or {}),
            "created_at": time.time(),
        }

        self._write_chunks(chunk_keys, chunks)
        self._commit(version, json.dumps(manifest), chunk_keys)
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

    def _prune(self) -> None:
        """Delete every version but the newest ``retention`` (the new latest is always kept)."""
        versions_key = weights_versions_key(self.run_id)
        old = self.client.zrange(versions_key, 0, -(self.retention + 1))
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
        """``(version, state_dict)`` of ``version`` (None: the latest), verified end to end."""
        if version is None:
            version = self.latest_version()
            if version is None:
                raise WeightsError(f"no weights published yet for run {self.run_id!r}")
        manifest = self.manifest(version)
        if manifest is None:
            raise WeightsError(f"weights version {version} of run {self.run_id!r} not found")
        try:
            num_chunks = int(manifest["num_chunks"])
            chunk_sha256: list[str] = list(manifest["chunk_sha256"])
            total_sha256 = str(manifest["sha256"])
            total_bytes = int(manifest["total_bytes"])
            expected: dict[str, dict[str, Any]] = dict(manifest["tensors"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsCorrupt(f"manifest of version {version} is malformed: {e!r}") from e
        if len(chunk_sha256) != num_chunks:
            raise WeightsCorrupt(
                f"version {version}: manifest lists {len(chunk_sha256)} checksums for "
                f"{num_chunks} chunks"
            )

        # One transaction: retention deletes a version atomically, so we see all chunks or none.
        pipe = self.client.pipeline(transaction=True)
        for i in range(num_chunks):
            pipe.get(weights_chunk_key(self.run_id, version, i))
        chunks: list[bytes | None] = pipe.execute()

        for i, (chunk, want) in enumerate(zip(chunks, chunk_sha256, strict=True)):
            if chunk is None:
                if self.manifest(version) is None:
                    raise WeightsError(f"weights version {version} expired while fetching")
                raise WeightsCorrupt(f"version {version}: chunk {i}/{num_chunks} is missing")
            got = hashlib.sha256(chunk).hexdigest()
            if got != want:
                raise WeightsCorrupt(
                    f"version {version}: chunk {i} sha256 {got[:12]}… != manifest {want[:12]}…"
                )
        data = b"".join(chunks)  # type: ignore[arg-type]  # None ruled out above
        if len(data) != total_bytes or hashlib.sha256(data).hexdigest() != total_sha256:
            raise WeightsCorrupt(
                f"version {version}: {len(data)} bytes do not match the manifest total "
                f"({total_bytes} bytes, sha256 {total_sha256[:12]}…)"
            )
        try:
            state_dict = safetensors.torch.load(data)
        except SafetensorError as e:
            raise WeightsCorrupt(f"version {version}: safetensors cannot parse: {e}") from e
        _check_against_manifest(version, state_dict, expected)
        return version, state_dict

    def watch(self, last_seen: int | None = None, poll_interval_s: float = 1.0) -> VersionWatcher:
        """A watcher that reports versions newer than ``last_seen`` (None: any version)."""
        return VersionWatcher(self.client, self.run_id, last_seen, poll_interval_s)


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


def store_from_config(cfg: RedisConfig, run_id: str) -> WeightStore:
    """The run's weight store on the configured Redis (learner and actors build it the same way)."""
    return WeightStore(
        redis.Redis.from_url(cfg.resolved_url()),
        run_id,
        chunk_bytes=cfg.chunk_bytes,
        retention=cfg.retention,
    )

"""The actors' side of the weight store (docs/design.md §6.4): ``WeightReader`` fetches a version,
verified end to end (see :meth:`WeightReader.fetch`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any, Self

import redis
import torch

from common import metric_names as mn
from common.config.run import RedisConfig
from common.weights.deltas import apply_delta
from common.weights.fetch.chunks import read_chunks
from common.weights.format import (
    WeightsCorrupt,
    WeightsError,
    check_finite,
    serialize_state_dict,
    tensors_from_safetensors,
    weights_digest,
)
from common.weights.host_cache import CacheRefused, HostCache
from common.weights.keys import weights_nodes_key
from common.weights.manifest import check_against_manifest, chunk_list
from common.weights.store import HeldVersion, WeightStore

logger = logging.getLogger(__name__)

REGISTER_EVERY_S = 30.0
"""How often a reader refreshes its node's listing (common/weights/publish/node_plane.py)."""

BYTES_WAIT_S = 120.0
"""How long a reader waits for the Redis bytes of a version committed before them."""


class WeightReader(WeightStore):
    """Fetches versions of a state dict for one run; remembers the last version it fetched (so
    the next fetch can be a delta), so a process uses one reader per run."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        host_cache: HostCache | None = None,
        **settings: int,
    ) -> None:
        super().__init__(client, run_id, **settings)
        self.host_cache = host_cache
        self.cache_refused = 0  # host-cache reads refused (see _from_host_cache)
        self.redis_chunk_bytes = 0  # bytes of weight chunks read from Redis
        self.redis_fallbacks = 0  # versions read from Redis chunks despite a host cache
        self._registered = -float("inf")  # when this reader last listed its node (monotonic)
        self._warned: set[str] = set()
        self._fetched: HeldVersion | None = None  # what the next delta we read may apply to

    @classmethod
    def from_config(cls, cfg: RedisConfig, run_id: str) -> Self:
        """The run's reader on the configured Redis, with the host cache where one is set."""
        reader = super().from_config(cfg, run_id)
        reader.host_cache = HostCache(cfg.host_cache_dir) if cfg.host_cache_dir else None
        return reader

    def fetch(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, state_dict)`` of ``version`` (None: the latest), verified end to end.

        A full version's tensors are views into one buffer holding its bytes (no copy after the
        socket read); a delta is applied to the version this reader fetched last when it is the
        delta's base, else to the chain from its keyframe, and the result must match the
        manifest's ``weights_sha256``. Non-finite floats are refused (``WeightsNonFinite``).
        With a host cache, one process per host reads from Redis and the others copy its file
        into their own memory and hash that copy.
        ``load_state_dict`` copies the tensors into a model as usual; do not modify them in
        place (they are the base of the next delta).
        """
        if version is None:
            version = self.latest_version()
            if version is None:
                raise WeightsError(f"no weights published yet for run {self.run_id!r}")
        manifest = self.checked_manifest(version)
        digest = manifest["weights_sha256"]
        held = self._fetched
        if held is not None and held.version == version and held.digest == digest:
            return version, held.state
        self.register_node()
        state, refused = self._from_host_cache(version, manifest)
        if state is None:
            with contextlib.ExitStack() as stack:
                locked = self._host_lock(stack, version, refused)
                # Another process of this host may have fetched it while we waited (a copy
                # refused a moment ago is not hashed twice: put() replaces it).
                if locked and not refused:
                    state, _ = self._from_host_cache(version, manifest)
                if state is None:
                    state, raw = self._build(version, manifest)
                    if locked:
                        self._host_put(version, digest, raw)
        self._fetched = HeldVersion(version, digest, state, int(manifest["keyframe"]))
        return version, state

    def stats(self) -> dict[str, float]:
        """``actor/host_cache_refused``: host-cache reads refused so far (see
        :meth:`_from_host_cache`; each was fetched from Redis instead);
        ``actor/redis_chunk_bytes``: bytes of weight chunks read from Redis;
        ``actor/weight_redis_fallbacks``: versions built from Redis chunks by this reader
        although it has a host cache (the node-local copy was absent, refused or not written)."""
        return {
            mn.ACTOR_HOST_CACHE_REFUSED: self.cache_refused,
            mn.ACTOR_REDIS_CHUNK_BYTES: self.redis_chunk_bytes,
            mn.ACTOR_WEIGHT_REDIS_FALLBACKS: self.redis_fallbacks,
        }

    def register_node(self) -> None:
        """List this reader's host cache as read by an actor of the run (at most every
        ``REGISTER_EVERY_S``): the learner writes versions into a node's cache while one is
        listed (common/weights/publish/node_plane.py). Best effort: a refused cache is logged."""
        now = time.monotonic()
        if self.host_cache is None or now - self._registered < REGISTER_EVERY_S:
            return
        self._registered = now
        try:
            node = self.host_cache.node_id(self.run_id)
        except (CacheRefused, OSError) as e:
            self._refuse(f"host weight cache: no node id ({e})", count=False)
            return
        self.client.hset(weights_nodes_key(self.run_id), node, str(time.time()))

    def _refuse(self, why: str, count: bool = True) -> None:
        """Count a refused host-cache read (``count``; not the lock or write of the same fetch)
        and log why, once per reason."""
        self.cache_refused += count
        if why not in self._warned:
            self._warned.add(why)
            logger.warning("%s; fetching from Redis instead", why)

    def _host_lock(self, stack: contextlib.ExitStack, version: int, refused: bool) -> bool:
        """Take the host's fetch lock of ``version`` on ``stack``; False without a cache or
        where its directory is refused (counted unless this fetch's read was, ``refused``)."""
        if self.host_cache is None:
            return False
        try:
            stack.enter_context(self.host_cache.lock(self.run_id, version))
        except CacheRefused as e:
            self._refuse(str(e), count=not refused)
            return False
        return True

    def _host_put(self, version: int, digest: str, raw: torch.Tensor | bytes) -> None:
        assert self.host_cache is not None
        try:
            self.host_cache.put(self.run_id, version, digest, raw)
        except CacheRefused as e:
            self._refuse(str(e), count=False)

    def _from_host_cache(
        self, version: int, manifest: Mapping[str, Any]
    ) -> tuple[dict[str, torch.Tensor] | None, bool]:
        """``version``'s state from the host cache, verified like a Redis read, and whether a
        cached copy was refused (None, False: no cache, or no copy there)."""
        if self.host_cache is None:
            return None, False
        digest = manifest["weights_sha256"]
        try:
            buf = self.host_cache.get(self.run_id, version, digest)
            if buf is None:
                return None, False
            # The end-to-end check a delta gets: the bytes copied into this process's memory
            # (never a mapping of the file, which a later write to it would change) must be
            # the manifest's weights. A copy swapped or changed after the fetcher wrote it is
            # refused here; one changed after this copy no longer matters.
            state = tensors_from_safetensors(version, buf)
            state = check_against_manifest(version, state, manifest["tensors"])
            got = weights_digest(state)
            if got != digest:
                raise WeightsCorrupt(
                    f"version {version}: weights hash to {got[:12]}…, manifest weights_sha256 "
                    f"says {digest[:12]}…"
                )
        except CacheRefused as e:
            self._refuse(str(e))
            return None, True
        except WeightsCorrupt as e:
            self._refuse(f"host weight cache: copy of version {version} refused: {e}")
            return None, True
        return state, False

    def _chain(
        self, version: int, manifest: dict[str, Any]
    ) -> tuple[list[tuple[int, dict[str, Any]]], HeldVersion | None]:
        """The versions to read for ``version``, oldest first, and the held state the first
        delta among them applies to: from a version we hold (or another process of this host
        built), else from the keyframe."""
        chain = [(version, manifest)]
        held = self._fetched
        while chain[-1][1]["kind"] == "delta":
            v, m = chain[-1]
            if held is not None and held.version == m["base"] and held.digest == m["base_sha256"]:
                break
            base = self.checked_manifest(m["base"]) if m["base"] < v else None
            base = self._stored(m["base"], base) if base is not None else None
            if base is None or base["weights_sha256"] != m["base_sha256"]:
                raise WeightsCorrupt(f"version {v}: its base {m['base']} is not the one it names")
            if self.host_cache is not None:
                cached, _ = self._from_host_cache(m["base"], base)
                if cached is not None:  # another process of this host built the base already
                    held = HeldVersion(m["base"], base["weights_sha256"], cached, base["keyframe"])
                    break
            chain.append((m["base"], base))
        chain.reverse()
        return chain, held

    def _build(
        self, version: int, manifest: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | bytes]:
        """The full state of ``version`` from Redis, and its safetensors bytes (for the host
        cache): a full read, or the deltas since a version we hold (or since the keyframe)."""
        if self.host_cache is not None:
            self.redis_fallbacks += 1
        manifest = self._stored(version, manifest)
        chain, held = self._chain(version, manifest)
        first_version, first = chain[0]
        # A state built here from a full version is this reader's alone until it is returned:
        # the deltas after it are applied in place. One from a held version is not (the caller
        # holds it, and a delta's result shares the tensors it left unchanged): each delta
        # copies what it changes.
        private = first["kind"] == "full"
        if private:
            buf = self._read_stored(first_version, first)
            state = tensors_from_safetensors(first_version, buf)
            state = check_against_manifest(first_version, state, first["tensors"])
            check_finite(first_version, state)
            if first.get("redis_bytes") == "stored":  # its chunk list came after the commit
                self._check_digest(first_version, state, first["weights_sha256"], "")
            raw: torch.Tensor | bytes = buf
            chain = chain[1:]
        else:
            assert held is not None
            state = held.state
        for v, m in chain:
            blob = tensors_from_safetensors(v, self._read_stored(v, m))
            state = apply_delta(v, state, blob, m["encoding"], in_place=private)
            check_against_manifest(v, state, m["tensors"])
            check_finite(v, state)
            self._check_digest(v, state, m["weights_sha256"], " after applying the delta")
        if manifest["kind"] == "delta":
            raw = serialize_state_dict(state) if self.host_cache is not None else b""
        return state, raw

    @staticmethod
    def _check_digest(version: int, state: dict[str, torch.Tensor], want: str, how: str) -> None:
        got = weights_digest(state)
        if got != want:
            raise WeightsCorrupt(
                f"version {version}: weights{how} hash to {got[:12]}…, manifest weights_sha256 "
                f"says {want[:12]}…"
            )

    def _stored(self, version: int, manifest: dict[str, Any]) -> dict[str, Any]:
        """``manifest`` once its Redis bytes are stored: a version committed before them (the
        node-local plane) is waited for, at most ``BYTES_WAIT_S``; raises ``WeightsError`` if it
        was pruned meanwhile or its bytes did not come."""
        deadline = time.monotonic() + BYTES_WAIT_S
        pause = 0.01
        while manifest.get("redis_bytes") == "pending":
            if time.monotonic() > deadline:
                raise WeightsError(
                    f"version {version}: its Redis bytes were not stored within {BYTES_WAIT_S:g} s"
                )
            time.sleep(pause)
            pause = min(0.2, pause * 2)
            manifest = self.checked_manifest(version)
        return manifest

    def _read_stored(self, version: int, manifest: Mapping[str, Any]) -> torch.Tensor:
        """The verified bytes of one stored version (a full version's or a delta's)."""
        manifest = self._stored(version, dict(manifest))
        chunk_sha256, total_bytes = chunk_list(version, manifest)
        self.redis_chunk_bytes += total_bytes
        return read_chunks(
            self.client,
            self.run_id,
            version,
            chunk_sha256,
            total_bytes,
            gone=lambda: self.manifest(version) is None,
        )

"""The Redis weight store (docs/design.md §6): versioned, chunked, checksummed safetensors bytes.

What both sides share: ``WeightStore`` holds a run's Redis client and settings, rebuilds itself
in another process (``recipe``/``from_recipe``) or from the config (``from_config``), and answers
the read-only queries (the latest version, a version's manifest). The learner publishes through
its subclass ``common.weights.publish.writer.WeightWriter``, the actors fetch through
``common.weights.fetch.reader.WeightReader``. The write order that makes every version a reader finds
complete is docs/design.md §6.1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Self

import redis
import torch

from common.config.run import RedisConfig
from common.weights.connection import portable_kwargs
from common.weights.keys import weights_bytes_key, weights_latest_key, weights_manifest_key
from common.weights.manifest import check_manifest, merge_bytes_record, parse_manifest


@dataclass(frozen=True)
class StoreSettings:
    """How a store writes and keeps versions (``WeightStore``'s arguments)."""

    chunk_bytes: int = 8 * 2**20
    retention: int = 3
    pending_ttl_s: int = 600
    keyframe_every: int = 1
    retention_bytes: int = 0

    def __post_init__(self) -> None:
        for name, ok, rule in (
            ("chunk_bytes", self.chunk_bytes > 0, "> 0"),
            ("retention", self.retention >= 1, ">= 1 (the latest is always kept)"),
            ("retention_bytes", self.retention_bytes >= 0, ">= 0 (0: no bound)"),
            ("pending_ttl_s", self.pending_ttl_s > 0, "> 0"),
            ("keyframe_every", self.keyframe_every >= 1, ">= 1 (1: no deltas)"),
        ):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}")


@dataclass
class HeldVersion:
    """A full version a store published or fetched: the base of the next delta."""

    version: int
    digest: str
    state: dict[str, torch.Tensor]
    keyframe: int


class WeightStore:
    """One run's versions in Redis: the settings and the read-only queries both sides use."""

    def __init__(self, client: redis.Redis, run_id: str, **settings: int) -> None:
        """``settings``: the fields of :class:`StoreSettings`."""
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("WeightStore needs a redis client with decode_responses=False")
        self.settings = StoreSettings(**settings)
        self.client = client
        self.run_id = run_id

    def recipe(self) -> dict[str, Any]:
        """What another process needs to build an equal store (``from_recipe`` of the same
        class): the Redis connection's class and arguments and this store's settings. A host
        cache and what the store remembers (delta bases) stay behind."""
        pool = self.client.connection_pool
        return {
            "connection_class": pool.connection_class,
            "connection_kwargs": portable_kwargs(pool.connection_kwargs),
            "run_id": self.run_id,
            **asdict(self.settings),
        }

    @classmethod
    def from_recipe(cls, recipe: Mapping[str, Any]) -> Self:
        settings = dict(recipe)
        settings.pop("host_cache_dir", None)  # a writer's node-local plane (its own from_recipe)
        pool = redis.ConnectionPool(
            connection_class=settings.pop("connection_class"),
            **settings.pop("connection_kwargs"),
        )
        return cls(redis.Redis(connection_pool=pool), **settings)

    @classmethod
    def from_config(cls, cfg: RedisConfig, run_id: str) -> Self:
        """The run's store on the configured Redis (learner and actors build it the same way)."""
        return cls(
            redis.Redis.from_url(cfg.resolved_url()),
            run_id,
            chunk_bytes=cfg.chunk_bytes,
            retention=cfg.retention,
            retention_bytes=cfg.retention_bytes,
            keyframe_every=cfg.keyframe_every,
        )

    def latest_version(self) -> int | None:
        raw = self.client.get(weights_latest_key(self.run_id))
        return int(raw) if raw is not None else None

    def manifest(self, version: int) -> dict[str, Any] | None:
        """The parsed manifest of ``version``, or None if it does not exist (or was pruned);
        with its bytes record merged in where it was committed before its Redis bytes."""
        raw, record = self.client.mget(
            weights_manifest_key(self.run_id, version), weights_bytes_key(self.run_id, version)
        )
        if raw is None:
            return None
        manifest = parse_manifest(raw, f"manifest of version {version}")
        return merge_bytes_record(manifest, record, f"bytes record of version {version}")

    def checked_manifest(self, version: int) -> dict[str, Any]:
        """The manifest of ``version`` once it is one a reader can use (``check_manifest``)."""
        return check_manifest(self.run_id, version, self.manifest(version))

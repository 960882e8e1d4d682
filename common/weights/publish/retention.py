"""Which stored versions a run keeps, and the deletion of the others: the newest ``retention``
versions with the delta chain they need, within ``retention_bytes``; a version goes as a whole
(manifest, bytes record and chunks) in one transaction, so a concurrent reader sees all of it or none."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis

from common.weights.keys import (
    weights_bytes_key,
    weights_chunk_key,
    weights_manifest_key,
    weights_versions_key,
)

logger = logging.getLogger(__name__)

Manifests = Callable[[int], dict[str, Any] | None]
"""A version's parsed manifest, or None once it is gone (``WeightStore.manifest``)."""


def keep_from(
    client: redis.Redis, run_id: str, retention: int, retention_bytes: int, manifest: Manifests
) -> int | None:
    """The oldest version to keep: the newest ``retention`` versions and the delta chain they
    need (from the keyframe of the oldest of them on), fewer while what is kept would hold
    more than ``retention_bytes`` (0: no bound); the latest and its chain are always kept."""
    versions_key = weights_versions_key(run_id)
    window = [int(v) for v in client.zrange(versions_key, -retention, -1)]
    # Each manifest is read once: the window's for their keyframes, and, only with a byte
    # bound, every stored version's for its size.
    stored = window
    if retention_bytes:
        stored = [int(v) for v in client.zrangebyscore(versions_key, "-inf", "+inf")]
    manifests = {v: manifest(v) or {} for v in stored}
    oldest_kept = None
    for oldest in reversed(window):
        keyframe = manifests[oldest].get("keyframe")
        start = min(oldest, keyframe) if isinstance(keyframe, int) else oldest
        if oldest_kept is not None and retention_bytes:
            held = sum(int(m.get("total_bytes", 0)) for v, m in manifests.items() if v >= start)
            if held > retention_bytes:
                break
        oldest_kept = start
    return oldest_kept


def prune(
    client: redis.Redis, run_id: str, retention: int, retention_bytes: int, manifest: Manifests
) -> None:
    """Delete every version of ``run_id`` older than :func:`keep_from` says to keep."""
    versions_key = weights_versions_key(run_id)
    oldest_kept = keep_from(client, run_id, retention, retention_bytes, manifest)
    if oldest_kept is None:
        return
    old = client.zrangebyscore(versions_key, "-inf", f"({oldest_kept}")
    for raw in old:
        version = int(raw)
        keys = [weights_manifest_key(run_id, version), weights_bytes_key(run_id, version)]
        stored = manifest(version)
        if stored is not None:  # no chunks listed: committed before its bytes, never stored
            chunks = int(stored.get("num_chunks", 0))
            keys += [weights_chunk_key(run_id, version, i) for i in range(chunks)]
        # One transaction: a concurrent reader sees the whole version or none of it.
        pipe = client.pipeline(transaction=True)
        pipe.delete(*keys)
        pipe.zrem(versions_key, raw)
        pipe.execute()
        logger.debug("pruned weights %s v%d", run_id, version)

"""The node-local weight plane, the learner's side (docs/design.md §6.5): a version goes into the
node's shared-memory weights cache (the host cache the actors of that node already read,
common/weights/host_cache.py) before it is committed in Redis, and its Redis bytes, for
actors on other nodes, follow the commit.

The learner writes into its cache only while an actor reading that same cache has registered
its node id in Redis (``weights:{run}:nodes``, refreshed at each of its fetches): the id lives
in the run's cache directory, so only processes sharing that directory (one host's ``/dev/shm``, or a
volume mounted into several containers) and uid (the directory is per uid) match. A learner
whose cache no actor reads therefore writes nothing there.

A version committed this way has ``planes.hostshm`` (the node id and file) and
``redis_bytes: "pending"`` in its manifest; its kind, delta base, encoding and chunk list
appear in ``weights:{run}:{version}:bytes`` once every chunk is in Redis (one script: the
chunks made permanent, then the record), and readers merge that record into the manifest
(:meth:`common.weights.store.WeightStore.manifest`). A reader that needs the bytes before then
waits for the record (:meth:`common.weights.fetch.reader.WeightReader.fetch`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import redis
import torch

from common.weights.format import WeightsError, writable
from common.weights.host_cache import CacheRefused, HostCache
from common.weights.keys import weights_bytes_key, weights_manifest_key, weights_nodes_key

logger = logging.getLogger(__name__)

NODE_FRESH_S = 600.0
"""An actor's registration counts this long after its last fetch."""

# KEYS[1]=manifest KEYS[2]=bytes record KEYS[3..]=chunks; ARGV[1]=record json.
# Returns 1 once stored, 0 if the version was pruned meanwhile, {-1, key} if a chunk is gone.
_BYTES_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return {-1, KEYS[i]} end
end
for i = 3, #KEYS do redis.call('PERSIST', KEYS[i]) end
redis.call('SET', KEYS[2], ARGV[1])
return 1
"""


class NodePlane:
    """Where a writer puts versions for the actors of its own node (the module docstring)."""

    def __init__(self, client: redis.Redis, run_id: str, cache: HostCache) -> None:
        self.client, self.run_id, self.cache = client, run_id, cache
        self._node: str | None = None
        self._off = False  # the cache directory was refused: Redis alone from then on
        self._script = client.register_script(_BYTES_LUA)
        self.written = 0
        """Versions written into the node's cache."""
        self.skipped = 0
        """Versions the plane could not take (no local actor listed, a refused directory, a
        full disk, a dtype its writer does not know): Redis alone carried them."""

    @property
    def root(self) -> str:
        return str(self.cache.parent)

    def node(self) -> str | None:
        """This node's id (None: the cache directory is refused, logged once)."""
        if self._node is None and not self._off:
            try:
                self._node = self.cache.node_id(self.run_id)
            except (CacheRefused, OSError) as e:
                self._off = True
                logger.warning("learner: node-local weights off: %s; Redis alone", e)
        return self._node

    def local_actors(self) -> bool:
        """Whether an actor reading this node's cache fetched a version recently."""
        node = self.node()
        if node is None:
            return False
        seen = self.client.hget(weights_nodes_key(self.run_id), node)
        return seen is not None and time.time() - float(seen) < NODE_FRESH_S

    def put(
        self, version: int, digest: str, state: Mapping[str, torch.Tensor], threads: int
    ) -> dict[str, Any] | None:
        """Write ``version`` into the node's cache while a local actor reads it; the
        manifest's ``planes`` entry, or None where Redis alone carries it."""
        if not self.local_actors() or not writable(state):
            self.skipped += 1
            return None
        try:
            done = self.cache.put_tensors(self.run_id, version, digest, state, threads)
        except (CacheRefused, OSError) as e:
            logger.warning("learner: version %d not written to the node's cache: %s", version, e)
            done = False
        if not done:
            self.skipped += 1
            return None
        self.written += 1
        node = self.node()
        name = self.cache.path(self.run_id, version, digest).name
        return {"hostshm": {"node": node, "file": name}}

    def store_bytes(self, version: int, record: dict[str, Any], chunk_keys: list[str]) -> bool:
        """Make ``version``'s chunks permanent and publish its bytes record; False where the
        version was pruned meanwhile (its chunks expire). Raises ``RuntimeError`` naming a
        chunk that expired before this (``WeightsError``)."""
        keys = [
            weights_manifest_key(self.run_id, version),
            weights_bytes_key(self.run_id, version),
            *chunk_keys,
        ]
        status = self._script(keys=keys, args=[json.dumps(record)])
        if isinstance(status, list):
            raise WeightsError(
                f"chunk {status[1].decode()} of version {version} expired before its bytes were "
                "stored (the write took longer than pending_ttl_s)"
            )
        return bool(status)

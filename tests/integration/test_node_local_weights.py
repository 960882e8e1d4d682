"""The node-local weight plane (docs/design.md §6.5) on a real Redis: the learner's Publisher
(upload in a child process, as the learner runs it) writes each version into the node's cache
before it commits it, and two actor processes on that node, each with its own WeightReader and
background weight feed, read no chunk bytes from Redis over 20 versions; the Redis bytes are
there for an actor on another node. Without the plane, and with a corrupt file, the actors
fall back to Redis, counted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
import torch

from benchmarks import cli
from benchmarks._procs import Children
from common import metric_names as mn
from common.weights.fetch.feed import RedisWeightFeed
from common.weights.fetch.reader import WeightReader
from common.weights.fetch.watcher import VersionWatcher
from common.weights.format import weights_digest
from common.weights.host_cache import HostCache
from common.weights.publish.writer import WeightWriter
from ops.redis_server import RedisServer
from testing.publishing import bf16_publisher

pytestmark = pytest.mark.integration

RUN = "node-local"
VERSIONS = 20
TIMEOUT_S = 120.0


def actor_main(index: int, url: str, root: str, results, holds, stop) -> None:
    """One actor of the node: its reader lists the node, then its feed takes every version it
    is offered, each checked against its manifest's digest, until ``stop``."""
    torch.set_num_threads(1)
    client = redis.Redis.from_url(url)
    reader = WeightReader(client, RUN, host_cache=HostCache(root), keyframe_every=5)
    reader.register_node()  # an actor does this at its first fetch; here before version 1
    watcher = VersionWatcher.of_store(reader, poll_interval_s=0.2)
    watcher.poll(timeout_s=0.0)  # subscribed before the first announcement
    feed = RedisWeightFeed(reader, watcher, current=0, poll_s=0.1)
    results.put(("ready", index))
    taken = []
    try:
        while not stop.is_set():
            update = feed.wait(0.2)
            if update is None:
                continue
            version, state = update
            assert weights_digest(state) == reader.manifest(version)["weights_sha256"]
            taken.append(version)
            holds[index] = version
        results.put(("done", index, taken, reader.stats(), feed.stats()))
    finally:
        feed.close()
        watcher.close()
        client.close()


def learner_step(model: torch.nn.Module, gen: torch.Generator) -> None:
    """A sparse update (a few rows of every matrix), so versions go out as deltas in Redis."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                rows = torch.randint(0, p.shape[0], (max(1, p.shape[0] // 50),), generator=gen)
                p[rows] += 1e-2


def run_node(url: str, client: redis.Redis, root: Path, plane: bool, versions: int) -> dict:
    """Publish ``versions`` versions (the plane on or off) while two actor processes of this
    node take each one; the Publisher's writer, each actor's figures and a remote reader's."""
    model = cli.random_model(512, 64, 128, 2, 4, 2, dtype=torch.bfloat16)
    store = WeightWriter(
        client, RUN, host_cache_dir=str(root) if plane else "", keyframe_every=5, retention=3
    )
    publisher = bf16_publisher(store, model)
    try:
        with Children(TIMEOUT_S, join_s=30.0) as children:
            holds = children.ctx.Array("i", [-1] * 2)
            for i in range(2):
                args = (i, url, str(root), children.results, holds, children.stop)
                children.start(actor_main, *args, name=f"actor {i}")
            children.each("ready")
            gen = torch.Generator().manual_seed(0)
            for version in range(1, versions + 1):
                learner_step(model, gen)
                publisher.publish(version)
                publisher.flush()
                deadline = time.monotonic() + TIMEOUT_S
                while min(holds[:]) < version:  # both actors hold it before the next one
                    assert time.monotonic() < deadline, list(holds[:])
                    time.sleep(0.01)
            children.stop.set()
            actors = [message[2:] for message in children.each("done")]
    finally:
        publisher.close()
    # An actor on another node: no host cache, every byte from Redis.
    remote = WeightReader(redis.Redis.from_url(url), RUN, keyframe_every=5)
    version, state = remote.fetch()
    assert version == versions
    assert weights_digest(state) == remote.manifest(version)["weights_sha256"]
    return {"actors": actors, "remote": remote.stats(), "store": store}


def test_local_actors_read_no_chunk_bytes_from_redis(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    figures = run_node(redis_server.url, redis_client, tmp_path, True, VERSIONS)
    local_actor_redis_chunk_bytes = 0
    for taken, stats, feed in figures["actors"]:
        assert taken == list(range(1, VERSIONS + 1))  # every version, in order
        assert feed[mn.ACTOR_WEIGHT_FETCH_FAILURES] == 0
        assert stats[mn.ACTOR_WEIGHT_REDIS_FALLBACKS] == 0
        assert stats[mn.ACTOR_HOST_CACHE_REFUSED] == 0
        local_actor_redis_chunk_bytes += stats[mn.ACTOR_REDIS_CHUNK_BYTES]
    assert local_actor_redis_chunk_bytes == 0
    # Every version was committed before its Redis bytes, which followed for other nodes.
    store = figures["store"]
    for version in range(VERSIONS - 2, VERSIONS + 1):  # those retention keeps
        manifest = store.manifest(version)
        assert manifest["planes"]["hostshm"]["node"] == HostCache(tmp_path).node_id(RUN)
        assert manifest["redis_bytes"] == "stored"
    assert {store.manifest(v)["kind"] for v in range(VERSIONS - 2, VERSIONS + 1)} >= {"delta"}
    assert figures["remote"][mn.ACTOR_REDIS_CHUNK_BYTES] > 0


def test_without_the_plane_the_actors_fall_back_to_redis_counted(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    figures = run_node(redis_server.url, redis_client, tmp_path, False, 3)
    fallbacks = sum(stats[mn.ACTOR_WEIGHT_REDIS_FALLBACKS] for _, stats, _ in figures["actors"])
    chunk_bytes = sum(stats[mn.ACTOR_REDIS_CHUNK_BYTES] for _, stats, _ in figures["actors"])
    # One actor of the node fetches each version from Redis (the other copies its file).
    assert fallbacks >= 3 and chunk_bytes > 0
    assert "planes" not in figures["store"].manifest(3)


def test_a_corrupt_node_file_is_refused_and_fetched_from_redis_counted(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    reader = WeightReader(redis_client, RUN, host_cache=HostCache(tmp_path))
    reader.register_node()
    writer = WeightWriter(redis_client, RUN, host_cache_dir=str(tmp_path))
    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 64, generator=gen), "b": torch.randn(64, generator=gen)}
    writer.publish(1, state)
    manifest = writer.manifest(1)
    path = HostCache(tmp_path).path(RUN, 1, manifest["weights_sha256"])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one bit of the last tensor's bytes: still a well-formed file
    path.write_bytes(bytes(data))
    version, got = reader.fetch(1)
    assert version == 1 and torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    stats = reader.stats()
    assert stats[mn.ACTOR_HOST_CACHE_REFUSED] == 1
    assert stats[mn.ACTOR_WEIGHT_REDIS_FALLBACKS] == 1
    assert stats[mn.ACTOR_REDIS_CHUNK_BYTES] == manifest["total_bytes"] > 0
    # The fallback's verified copy replaced the corrupt file: the next local read is clean.
    again = WeightReader(redis_client, RUN, host_cache=HostCache(tmp_path))
    again.fetch(1)
    assert again.stats()[mn.ACTOR_REDIS_CHUNK_BYTES] == 0

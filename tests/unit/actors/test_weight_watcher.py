"""The actors' version watcher against a real Redis: pub/sub, its polling fallback, and a Redis
restart."""

from __future__ import annotations

import threading

import pytest
import redis
import torch

from common.weights.fetch.watcher import VersionWatcher
from common.weights.keys import weights_latest_key
from common.weights.publish.writer import WeightWriter
from ops.redis_server import RedisServer

RUN = "watch-run"


def weights(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 4), float(seed)), "step": torch.tensor(seed)}


@pytest.fixture
def store(redis_client: redis.Redis) -> WeightWriter:
    return WeightWriter(redis_client, RUN, chunk_bytes=64, retention=3)


def test_watcher_receives_published_version(store: WeightWriter) -> None:
    store.publish(1, weights(1))
    # A long poll interval: only the pub/sub message can deliver version 2 in time.
    with VersionWatcher.of_store(store, last_seen=1, poll_interval_s=30.0) as watcher:
        assert watcher.poll(timeout_s=0.2) is None  # subscribes; nothing new yet
        publisher = threading.Timer(0.1, store.publish, args=(2, weights(2)))
        publisher.start()
        try:
            assert watcher.poll(timeout_s=5.0) == 2
        finally:
            publisher.join()
        assert watcher.last_seen == 2


def test_watcher_without_last_seen_reports_current(store: WeightWriter) -> None:
    store.publish(3, weights(3))
    with VersionWatcher.of_store(store) as watcher:
        assert watcher.poll(timeout_s=1.0) == 3
        assert watcher.poll(timeout_s=0.1) is None


def test_watcher_polls_latest_when_message_missed(
    store: WeightWriter, redis_client: redis.Redis
) -> None:
    store.publish(1, weights(1))
    with VersionWatcher.of_store(store, last_seen=1, poll_interval_s=0.1) as watcher:
        assert watcher.poll(timeout_s=0.2) is None
        # Move `latest` without any announcement: only polling can notice.
        redis_client.set(weights_latest_key(RUN), 2)
        assert watcher.poll(timeout_s=2.0) == 2


def test_watcher_picks_newest_of_several(store: WeightWriter) -> None:
    with VersionWatcher.of_store(store, last_seen=0, poll_interval_s=30.0) as watcher:
        assert watcher.poll(timeout_s=0.1) is None
        for v in (1, 2, 3):
            store.publish(v, weights(v))
        assert watcher.poll(timeout_s=2.0) == 3


def test_watcher_survives_redis_restart() -> None:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        store = WeightWriter(client, RUN, chunk_bytes=1024)
        store.publish(1, weights(1))
        watcher = VersionWatcher(redis.Redis.from_url(server.url), RUN, 1, poll_interval_s=0.1)
        assert watcher.poll(timeout_s=0.2) is None

        server.stop()
        assert watcher.poll(timeout_s=0.3) is None  # keeps running, no exception

        server.start()  # same port; data gone (no persistence), the learner republishes
        store.publish(2, weights(2))
        # The first poll after the outage may still hit a dead socket; a later one must succeed.
        seen = []
        while len(seen) < 3 and 2 not in seen:
            seen.append(watcher.poll(timeout_s=1.0))
        assert 2 in seen, seen
        watcher.close()
        client.close()


def test_watcher_survives_a_redis_that_stops_answering() -> None:
    # A network partition: the socket stays open and reads time out (redis.TimeoutError, not a
    # ConnectionError). The watcher must log and go on, not end the actor's weight feed.
    import os
    import signal

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        WeightWriter(client, RUN, chunk_bytes=1024).publish(1, weights(1))
        slow = redis.Redis.from_url(server.url, socket_timeout=0.2)
        watcher = VersionWatcher(slow, RUN, 1, poll_interval_s=0.05)
        assert watcher.poll(timeout_s=0.2) is None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            assert watcher.poll(timeout_s=0.5) is None  # timed out reading: no exception
        finally:
            os.kill(server.pid, signal.SIGCONT)
        WeightWriter(client, RUN, chunk_bytes=1024).publish(2, weights(2))
        seen = [watcher.poll(timeout_s=1.0) for _ in range(3)]
        assert 2 in seen, seen
        watcher.close()
        slow.close()
        client.close()

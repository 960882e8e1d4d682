"""The Redis weight store against a real Redis: round trips, corruption, atomicity, retention,
and the version watcher (pub/sub and its polling fallback)."""

from __future__ import annotations

import json
import threading

import pytest
import redis
import safetensors.torch
import torch

from common.protocol import (
    weights_channel,
    weights_chunk_key,
    weights_latest_key,
    weights_manifest_key,
    weights_versions_key,
)
from common.weights import (
    VersionWatcher,
    WeightsCorrupt,
    WeightsError,
    WeightStore,
    serialize_state_dict,
)
from ops.redis_server import RedisServer

RUN = "test-run"


def make_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),  # float32
        "layers.0.attn.q.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(8, generator=g).to(torch.float16),
        "position_ids": torch.arange(32, dtype=torch.int64),
        "step": torch.tensor(seed, dtype=torch.int64),  # 0-dim
        "mask": torch.rand(5, generator=g) > 0.5,  # bool
    }


def assert_state_dicts_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


@pytest.fixture
def store(redis_client: redis.Redis) -> WeightStore:
    # 64-byte chunks: a few-KB state dict spans dozens of chunks.
    return WeightStore(redis_client, RUN, chunk_bytes=64, retention=3)


def test_round_trip_many_chunks(store: WeightStore, redis_client: redis.Redis) -> None:
    sd = make_state_dict()
    store.publish(1, sd, meta={"step": 10, "loss": 0.5, "tag": "x"})

    manifest = store.manifest(1)
    assert manifest is not None
    assert manifest["num_chunks"] > 10
    assert manifest["meta"] == {"step": 10, "loss": 0.5, "tag": "x"}
    assert manifest["tensors"]["step"] == {"shape": [], "dtype": "int64"}
    assert manifest["tensors"]["layers.0.attn.q.weight"]["dtype"] == "bfloat16"
    assert all(
        len(redis_client.get(weights_chunk_key(RUN, 1, i))) <= 64
        for i in range(manifest["num_chunks"])
    )

    version, got = store.fetch()
    assert version == 1
    assert_state_dicts_equal(sd, got)
    # Byte-for-byte: re-serialising what we read gives exactly what was stored.
    assert serialize_state_dict(got) == serialize_state_dict(sd)
    assert store.latest_version() == 1


def test_committed_chunks_do_not_expire(store: WeightStore, redis_client: redis.Redis) -> None:
    store.publish(1, make_state_dict())
    assert redis_client.ttl(weights_chunk_key(RUN, 1, 0)) == -1  # -1: no expiry


def test_tied_weights_are_published(store: WeightStore) -> None:
    shared = torch.randn(4, 4)
    store.publish(1, {"embed.weight": shared, "lm_head.weight": shared})
    _, got = store.fetch(1)
    assert torch.equal(got["embed.weight"], shared) and torch.equal(got["lm_head.weight"], shared)


def test_corrupted_chunk_raises(store: WeightStore, redis_client: redis.Redis) -> None:
    store.publish(1, make_state_dict())
    key = weights_chunk_key(RUN, 1, 3)
    original = redis_client.get(key)
    redis_client.set(key, bytes(b ^ 0xFF for b in original))  # same length, other bytes
    with pytest.raises(WeightsCorrupt, match="chunk 3 sha256"):
        store.fetch()


def test_missing_chunk_raises_corrupt(store: WeightStore, redis_client: redis.Redis) -> None:
    store.publish(1, make_state_dict())
    redis_client.delete(weights_chunk_key(RUN, 1, 2))
    with pytest.raises(WeightsCorrupt, match="missing"):
        store.fetch(1)


def test_manifest_with_wrong_shape_raises(store: WeightStore, redis_client: redis.Redis) -> None:
    store.publish(1, make_state_dict())
    manifest = store.manifest(1)
    assert manifest is not None
    manifest["tensors"]["embed.weight"]["shape"] = [8, 16]
    redis_client.set(weights_manifest_key(RUN, 1), json.dumps(manifest))
    with pytest.raises(WeightsCorrupt, match="shape"):
        store.fetch(1)


def test_manifest_with_wrong_dtype_raises(store: WeightStore, redis_client: redis.Redis) -> None:
    store.publish(1, make_state_dict())
    manifest = store.manifest(1)
    assert manifest is not None
    manifest["tensors"]["embed.weight"]["dtype"] = "float16"
    redis_client.set(weights_manifest_key(RUN, 1), json.dumps(manifest))
    with pytest.raises(WeightsCorrupt, match="dtype"):
        store.fetch(1)


def test_half_written_version_is_invisible(
    store: WeightStore, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    v1 = make_state_dict(1)
    store.publish(1, v1)

    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("writer died between chunks and manifest")

    monkeypatch.setattr(store, "_commit", crash)
    with pytest.raises(RuntimeError, match="writer died"):
        store.publish(2, make_state_dict(2))
    assert redis_client.exists(weights_chunk_key(RUN, 2, 0))  # chunks were written...
    assert redis_client.ttl(weights_chunk_key(RUN, 2, 0)) > 0  # ...and will expire on their own

    assert store.latest_version() == 1
    version, got = store.fetch()
    assert version == 1
    assert_state_dicts_equal(v1, got)
    with pytest.raises(WeightsError, match="not found"):
        store.fetch(2)


def test_fetch_errors_when_nothing_published(store: WeightStore) -> None:
    assert store.latest_version() is None
    assert store.manifest(1) is None
    with pytest.raises(WeightsError, match="no weights"):
        store.fetch()
    with pytest.raises(WeightsError, match="not found"):
        store.fetch(7)


def test_latest_never_goes_backwards(store: WeightStore) -> None:
    store.publish(5, make_state_dict(5))
    with pytest.raises(WeightsError, match="only grow"):
        store.publish(5, make_state_dict(6))
    with pytest.raises(WeightsError, match="only grow"):
        store.publish(3, make_state_dict(3))
    assert store.latest_version() == 5
    store.publish(9, make_state_dict(9))  # gaps are fine
    assert store.latest_version() == 9


def test_commit_refuses_a_version_that_lost_a_race(store: WeightStore) -> None:
    # Two writers: both pass the client-side check, the slower commit must not move latest back.
    other = WeightStore(store.client, RUN, chunk_bytes=64)

    def stale_latest() -> int | None:
        other.publish(10, make_state_dict(10))  # the other writer wins after our check
        return None

    store.latest_version = stale_latest  # type: ignore[method-assign]
    with pytest.raises(WeightsError, match="latest moved to 10"):
        store.publish(4, make_state_dict(4))
    assert other.latest_version() == 10
    assert store.manifest(4) is None


def test_retention_deletes_old_versions(redis_client: redis.Redis) -> None:
    store = WeightStore(redis_client, RUN, chunk_bytes=256, retention=2)
    for v in range(1, 6):
        store.publish(v, make_state_dict(v))

    assert store.latest_version() == 5
    assert [int(v) for v in redis_client.zrange(weights_versions_key(RUN), 0, -1)] == [4, 5]
    prefix = f"weights:{RUN}:"
    keys = {k.decode() for k in redis_client.scan_iter(match=prefix + "*")}
    for v in (1, 2, 3):
        assert not any(k.startswith(f"{prefix}{v}:") for k in keys), v
        with pytest.raises(WeightsError, match="not found"):
            store.fetch(v)
    for v in (4, 5):
        assert_state_dicts_equal(store.fetch(v)[1], make_state_dict(v))


def test_retention_bytes_keeps_fewer_versions_than_the_count(redis_client: redis.Redis) -> None:
    one = WeightStore(redis_client, "sizer", chunk_bytes=256)
    one.publish(1, make_state_dict(1))
    size = int(one.manifest(1)["total_bytes"])
    # Room for two versions of this size, not three: the count (4) never binds.
    store = WeightStore(
        redis_client, RUN, chunk_bytes=256, retention=4, retention_bytes=int(2.5 * size)
    )
    for v in range(1, 6):
        store.publish(v, make_state_dict(v))
    assert [int(v) for v in redis_client.zrange(weights_versions_key(RUN), 0, -1)] == [4, 5]
    assert_state_dicts_equal(store.fetch(4)[1], make_state_dict(4))
    with pytest.raises(WeightsError, match="not found"):
        store.fetch(3)


def test_retention_bytes_below_one_version_still_keeps_the_latest(
    redis_client: redis.Redis,
) -> None:
    store = WeightStore(redis_client, RUN, chunk_bytes=256, retention=3, retention_bytes=1)
    for v in range(1, 4):
        store.publish(v, make_state_dict(v))
    assert [int(v) for v in redis_client.zrange(weights_versions_key(RUN), 0, -1)] == [3]
    assert_state_dicts_equal(store.fetch(3)[1], make_state_dict(3))


def test_retention_bytes_is_validated(redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="retention_bytes"):
        WeightStore(redis_client, RUN, retention_bytes=-1)


def test_rejects_decoding_client(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses"):
        WeightStore(client, RUN)


def test_watcher_receives_published_version(store: WeightStore) -> None:
    store.publish(1, make_state_dict(1))
    # A long poll interval: only the pub/sub message can deliver version 2 in time.
    with store.watch(last_seen=1, poll_interval_s=30.0) as watcher:
        assert watcher.poll(timeout_s=0.2) is None  # subscribes; nothing new yet
        publisher = threading.Timer(0.1, store.publish, args=(2, make_state_dict(2)))
        publisher.start()
        try:
            assert watcher.poll(timeout_s=5.0) == 2
        finally:
            publisher.join()
        assert watcher.last_seen == 2


def test_watcher_without_last_seen_reports_current(store: WeightStore) -> None:
    store.publish(3, make_state_dict(3))
    with store.watch() as watcher:
        assert watcher.poll(timeout_s=1.0) == 3
        assert watcher.poll(timeout_s=0.1) is None


def test_watcher_polls_latest_when_message_missed(
    store: WeightStore, redis_client: redis.Redis
) -> None:
    store.publish(1, make_state_dict(1))
    with store.watch(last_seen=1, poll_interval_s=0.1) as watcher:
        assert watcher.poll(timeout_s=0.2) is None
        # Move `latest` without any announcement: only polling can notice.
        redis_client.set(weights_latest_key(RUN), 2)
        assert watcher.poll(timeout_s=2.0) == 2


def test_watcher_picks_newest_of_several(store: WeightStore) -> None:
    with store.watch(last_seen=0, poll_interval_s=30.0) as watcher:
        assert watcher.poll(timeout_s=0.1) is None
        for v in (1, 2, 3):
            store.publish(v, make_state_dict(v))
        assert watcher.poll(timeout_s=2.0) == 3


def test_watcher_survives_redis_restart() -> None:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        store = WeightStore(client, RUN, chunk_bytes=1024)
        store.publish(1, make_state_dict(1))
        watcher = VersionWatcher(redis.Redis.from_url(server.url), RUN, 1, poll_interval_s=0.1)
        assert watcher.poll(timeout_s=0.2) is None

        server.stop()
        assert watcher.poll(timeout_s=0.3) is None  # keeps running, no exception

        server.start()  # same port; data gone (no persistence), the learner republishes
        store.publish(2, make_state_dict(2))
        # The first poll after the outage may still hit a dead socket; a later one must succeed.
        seen = []
        while len(seen) < 3 and 2 not in seen:
            seen.append(watcher.poll(timeout_s=1.0))
        assert 2 in seen, seen
        watcher.close()
        client.close()


def test_announcement_is_on_protocol_channel(store: WeightStore, redis_client: redis.Redis) -> None:
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(weights_channel(RUN))
    pubsub.get_message(timeout=0.5)  # the subscribe confirmation
    store.publish(7, make_state_dict(7))
    message = pubsub.get_message(timeout=2.0)
    assert message is not None and int(message["data"]) == 7
    pubsub.close()


def test_fallback_reader_gives_the_same_state_dict(
    store: WeightStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client kinds whose socket cannot be read directly go through redis-py's parser."""
    sd = make_state_dict(3)
    store.publish(1, sd)
    monkeypatch.setattr(store, "_raw_connection", lambda: None)
    _, fetched = store.fetch(1)
    assert_state_dicts_equal(sd, fetched)


def test_manifest_of_another_format_is_refused(
    store: WeightStore, redis_client: redis.Redis
) -> None:
    store.publish(1, make_state_dict())
    key = weights_manifest_key(RUN, 1)
    manifest = json.loads(redis_client.get(key))
    manifest["format"] = 1
    redis_client.set(key, json.dumps(manifest))
    with pytest.raises(WeightsError):
        store.fetch(1)


def test_serialized_bytes_are_safetensors_the_library_reads() -> None:
    sd = make_state_dict(3)
    sd["tied"] = sd["embed.weight"]  # shared storage is written twice, as two tensors
    sd["empty"] = torch.zeros(0, 4)
    data = serialize_state_dict(sd)
    loaded = safetensors.torch.load(bytes(data))
    assert loaded.keys() == sd.keys()
    for name, t in sd.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    # Every tensor starts at a multiple of its element size, as safetensors writes them.
    header_len = int.from_bytes(data[:8], "little")
    assert (8 + header_len) % 8 == 0
    header = json.loads(bytes(data[8 : 8 + header_len]))
    for name, spec in header.items():
        begin = spec["data_offsets"][0]
        assert begin % sd[name].element_size() == 0, name

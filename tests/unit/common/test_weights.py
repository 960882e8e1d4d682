"""The Redis weight store against a real Redis: round trips, corruption, atomicity, retention,
the announcement of a version, and the fallback chunk reader."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import redis
import safetensors.torch
import torch

import common.weights.fetch.chunks as chunks_module
from common.config.run import RedisConfig
from common.weights.fetch.reader import WeightReader
from common.weights.format import WeightsCorrupt, WeightsError, serialize_state_dict
from common.weights.keys import (
    weights_channel,
    weights_chunk_key,
    weights_manifest_key,
    weights_versions_key,
)
from common.weights.publish.writer import WeightWriter
from common.weights.store import WeightStore
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
def store(redis_client: redis.Redis) -> WeightWriter:
    # 64-byte chunks: a few-KB state dict spans dozens of chunks.
    return WeightWriter(redis_client, RUN, chunk_bytes=64, retention=3)


@pytest.fixture
def reader(store: WeightWriter) -> WeightReader:
    """An actor's reader of the run ``store`` writes."""
    return WeightReader.from_recipe(store.recipe())


def test_round_trip_many_chunks(
    store: WeightWriter, reader: WeightReader, redis_client: redis.Redis
) -> None:
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

    version, got = reader.fetch()
    assert version == 1
    assert_state_dicts_equal(sd, got)
    # Byte-for-byte: re-serialising what we read gives exactly what was stored.
    assert serialize_state_dict(got) == serialize_state_dict(sd)
    assert store.latest_version() == 1


def test_committed_chunks_do_not_expire(store: WeightWriter, redis_client: redis.Redis) -> None:
    store.publish(1, make_state_dict())
    assert redis_client.ttl(weights_chunk_key(RUN, 1, 0)) == -1  # -1: no expiry


def test_tied_weights_are_published(store: WeightWriter, reader: WeightReader) -> None:
    shared = torch.randn(4, 4)
    store.publish(1, {"embed.weight": shared, "lm_head.weight": shared})
    _, got = reader.fetch(1)
    assert torch.equal(got["embed.weight"], shared) and torch.equal(got["lm_head.weight"], shared)


def test_corrupted_chunk_raises(
    store: WeightWriter, reader: WeightReader, redis_client: redis.Redis
) -> None:
    store.publish(1, make_state_dict())
    key = weights_chunk_key(RUN, 1, 3)
    original = redis_client.get(key)
    redis_client.set(key, bytes(b ^ 0xFF for b in original))  # same length, other bytes
    with pytest.raises(WeightsCorrupt, match="chunk 3 sha256"):
        reader.fetch()


def test_missing_chunk_raises_corrupt(
    store: WeightWriter, reader: WeightReader, redis_client: redis.Redis
) -> None:
    store.publish(1, make_state_dict())
    redis_client.delete(weights_chunk_key(RUN, 1, 2))
    with pytest.raises(WeightsCorrupt, match="missing"):
        reader.fetch(1)


def tamper_tensor_spec(
    store: WeightWriter, redis_client: redis.Redis, field: str, value: object
) -> None:
    """Publish version 1, then make its manifest list ``field`` of embed.weight as ``value``."""
    store.publish(1, make_state_dict())
    manifest = store.manifest(1)
    assert manifest is not None
    manifest["tensors"]["embed.weight"][field] = value
    redis_client.set(weights_manifest_key(RUN, 1), json.dumps(manifest))


def test_manifest_with_wrong_shape_raises(
    store: WeightWriter, reader: WeightReader, redis_client: redis.Redis
) -> None:
    tamper_tensor_spec(store, redis_client, "shape", [8, 16])
    with pytest.raises(WeightsCorrupt, match="shape"):
        reader.fetch(1)


def test_manifest_with_wrong_dtype_raises(
    store: WeightWriter, reader: WeightReader, redis_client: redis.Redis
) -> None:
    tamper_tensor_spec(store, redis_client, "dtype", "float16")
    with pytest.raises(WeightsCorrupt, match="dtype"):
        reader.fetch(1)


def test_half_written_version_is_invisible(
    store: WeightWriter,
    reader: WeightReader,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
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
    version, got = reader.fetch()
    assert version == 1
    assert_state_dicts_equal(v1, got)
    with pytest.raises(WeightsError, match="not found"):
        reader.fetch(2)


def test_fetch_errors_when_nothing_published(store: WeightWriter, reader: WeightReader) -> None:
    assert store.latest_version() is None
    assert store.manifest(1) is None
    with pytest.raises(WeightsError, match="no weights"):
        reader.fetch()
    with pytest.raises(WeightsError, match="not found"):
        reader.fetch(7)


def test_latest_never_goes_backwards(store: WeightWriter) -> None:
    store.publish(5, make_state_dict(5))
    with pytest.raises(WeightsError, match="only grow"):
        store.publish(5, make_state_dict(6))
    with pytest.raises(WeightsError, match="only grow"):
        store.publish(3, make_state_dict(3))
    assert store.latest_version() == 5
    store.publish(9, make_state_dict(9))  # gaps are fine
    assert store.latest_version() == 9


def test_commit_refuses_a_version_that_lost_a_race(store: WeightWriter) -> None:
    # Two writers: both pass the client-side check, the slower commit must not move latest back.
    other = WeightWriter(store.client, RUN, chunk_bytes=64)

    def stale_latest() -> int | None:
        other.publish(10, make_state_dict(10))  # the other writer wins after our check
        return None

    store.latest_version = stale_latest  # type: ignore[method-assign]
    with pytest.raises(WeightsError, match="latest moved to 10"):
        store.publish(4, make_state_dict(4))
    assert other.latest_version() == 10
    assert store.manifest(4) is None


def test_retention_deletes_old_versions(redis_client: redis.Redis) -> None:
    store = WeightWriter(redis_client, RUN, chunk_bytes=256, retention=2)
    reader = WeightReader(redis_client, RUN)
    for v in range(1, 6):
        store.publish(v, make_state_dict(v))

    assert store.latest_version() == 5
    assert [int(v) for v in redis_client.zrange(weights_versions_key(RUN), 0, -1)] == [4, 5]
    prefix = f"weights:{RUN}:"
    keys = {k.decode() for k in redis_client.scan_iter(match=prefix + "*")}
    for v in (1, 2, 3):
        assert not any(k.startswith(f"{prefix}{v}:") for k in keys), v
        with pytest.raises(WeightsError, match="not found"):
            reader.fetch(v)
    for v in (4, 5):
        assert_state_dicts_equal(reader.fetch(v)[1], make_state_dict(v))


def test_retention_bytes_keeps_fewer_versions_than_the_count(redis_client: redis.Redis) -> None:
    one = WeightWriter(redis_client, "sizer", chunk_bytes=256)
    one.publish(1, make_state_dict(1))
    size = int(one.manifest(1)["total_bytes"])
    # Room for two versions of this size, not three: the count (4) never binds.
    store = WeightWriter(
        redis_client, RUN, chunk_bytes=256, retention=4, retention_bytes=int(2.5 * size)
    )
    for v in range(1, 6):
        store.publish(v, make_state_dict(v))
    assert [int(v) for v in redis_client.zrange(weights_versions_key(RUN), 0, -1)] == [4, 5]
    reader = WeightReader(redis_client, RUN)
    assert_state_dicts_equal(reader.fetch(4)[1], make_state_dict(4))
    with pytest.raises(WeightsError, match="not found"):
        reader.fetch(3)


def test_retention_bytes_below_one_version_still_keeps_the_latest(
    redis_client: redis.Redis,
) -> None:
    store = WeightWriter(redis_client, RUN, chunk_bytes=256, retention=3, retention_bytes=1)
    for v in range(1, 4):
        store.publish(v, make_state_dict(v))
    assert [int(v) for v in redis_client.zrange(weights_versions_key(RUN), 0, -1)] == [3]
    assert_state_dicts_equal(WeightReader(redis_client, RUN).fetch(3)[1], make_state_dict(3))


def test_retention_bytes_is_validated(redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="retention_bytes"):
        WeightStore(redis_client, RUN, retention_bytes=-1)


def test_rejects_decoding_client(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses"):
        WeightStore(client, RUN)


def test_each_side_builds_its_store_from_config_and_recipe(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    cfg = RedisConfig(url=redis_server.url, chunk_bytes=2048, keyframe_every=1, host_cache_dir="")
    writer = WeightWriter.from_config(cfg, RUN)
    assert type(writer) is WeightWriter and writer.settings.chunk_bytes == 2048
    writer.publish(1, make_state_dict(1))
    # A recipe builds the class it is called on, with the same settings and no host cache.
    again = WeightWriter.from_recipe(writer.recipe())
    assert type(again) is WeightWriter and again.settings == writer.settings
    reader = WeightReader.from_recipe(writer.recipe())
    assert type(reader) is WeightReader and reader.host_cache is None
    assert_state_dicts_equal(reader.fetch(1)[1], make_state_dict(1))
    cached = WeightReader.from_config(replace(cfg, host_cache_dir=str(tmp_path)), RUN)
    assert cached.host_cache is not None and cached.host_cache.root.parent == tmp_path
    assert WeightReader.from_config(cfg, RUN).host_cache is None
    assert_state_dicts_equal(cached.fetch(1)[1], make_state_dict(1))


def test_announcement_is_on_protocol_channel(
    store: WeightWriter, redis_client: redis.Redis
) -> None:
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(weights_channel(RUN))
    pubsub.get_message(timeout=0.5)  # the subscribe confirmation
    store.publish(7, make_state_dict(7))
    message = pubsub.get_message(timeout=2.0)
    assert message is not None and int(message["data"]) == 7
    pubsub.close()


def test_fallback_reader_gives_the_same_state_dict(
    store: WeightWriter, reader: WeightReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client kinds whose socket cannot be read directly go through redis-py's parser."""
    sd = make_state_dict(3)
    store.publish(1, sd)
    monkeypatch.setattr(chunks_module, "raw_connection", lambda client: None)
    _, fetched = reader.fetch(1)
    assert_state_dicts_equal(sd, fetched)


def test_manifest_of_another_format_is_refused(
    store: WeightWriter, reader: WeightReader, redis_client: redis.Redis
) -> None:
    store.publish(1, make_state_dict())
    key = weights_manifest_key(RUN, 1)
    manifest = json.loads(redis_client.get(key))
    manifest["format"] = 1
    redis_client.set(key, json.dumps(manifest))
    with pytest.raises(WeightsError):
        reader.fetch(1)


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

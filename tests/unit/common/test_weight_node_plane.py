"""The node-local weight plane's parts (docs/design.md §6.5) on a real Redis: the node cache's
file written straight from tensors, the node id, the learner writing only for listed actors,
a version committed before its Redis bytes (a reader elsewhere waits for them, a retry after
an outage stores them), the threaded finite check and deltas applied in place."""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import redis
import torch

import common.weights.format as format_module
import common.weights.publish.writer as writer_module
from common import metric_names as mn
from common.config.run import RedisConfig
from common.weights.deltas import apply_delta
from common.weights.fetch.reader import WeightReader
from common.weights.format import (
    WeightsNonFinite,
    check_finite,
    serialize_state_dict,
    tensors_from_safetensors,
)
from common.weights.host_cache import CacheRefused, HostCache
from common.weights.publish.writer import WeightWriter, encode_delta
from ops.redis_server import RedisServer

RUN = "node-plane"


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(300, 64, generator=gen).to(torch.bfloat16),
        "norm": torch.randn(64, generator=gen),
        "steps": torch.arange(5),
    }


@pytest.mark.parametrize("threads", [1, 3])
def test_a_file_written_from_tensors_is_the_safetensors_file_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    import common.weights.host_cache as cache_module

    monkeypatch.setattr(cache_module, "WRITE_BLOCK", 1000)  # big tensors in several writes
    cache, state = HostCache(tmp_path), make_state()
    assert cache.put_tensors(RUN, 3, "ab" * 32, state, threads)
    path = cache.path(RUN, 3, "ab" * 32)
    assert path.read_bytes() == bytes(serialize_state_dict(state))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    got = tensors_from_safetensors(3, cache.get(RUN, 3, "ab" * 32, threads))  # ranges too
    assert all(torch.equal(got[name], t) for name, t in state.items())
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_the_node_id_is_one_per_directory_and_never_read_through_a_symlink(
    tmp_path: Path,
) -> None:
    first = HostCache(tmp_path / "a").node_id(RUN)
    assert HostCache(tmp_path / "a").node_id(RUN) == first  # every process of the node
    assert HostCache(tmp_path / "b").node_id(RUN) != first  # another node (or uid)
    id_file = HostCache(tmp_path / "a").path(RUN, 0, "0" * 64).with_name("node-id")
    assert stat.S_IMODE(id_file.stat().st_mode) == 0o600
    id_file.unlink()
    elsewhere = tmp_path / "planted"
    elsewhere.write_text("0" * 32)
    id_file.symlink_to(elsewhere)
    with pytest.raises(CacheRefused, match="symlink"):
        HostCache(tmp_path / "a").node_id(RUN)
    HostCache(tmp_path / "a").remove_run(RUN)  # the id goes with the run's copies
    assert not id_file.parent.exists()


def test_the_learner_writes_into_its_node_only_while_an_actor_there_is_listed(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    writer = WeightWriter(redis_client, RUN, host_cache_dir=str(tmp_path))
    writer.publish(1, make_state(1))
    assert "planes" not in writer.manifest(1)  # nobody reads this node's cache
    assert writer.node_plane is not None and writer.node_plane.skipped == 1
    reader = WeightReader(redis_client, RUN, host_cache=HostCache(tmp_path))
    reader.fetch(1)  # from Redis; lists the node
    assert reader.stats()[mn.ACTOR_WEIGHT_REDIS_FALLBACKS] == 1
    writer.publish(2, make_state(2))
    manifest = writer.manifest(2)
    assert manifest["planes"]["hostshm"]["node"] == HostCache(tmp_path).node_id(RUN)
    before = reader.stats()[mn.ACTOR_REDIS_CHUNK_BYTES]
    version, state = reader.fetch(2)
    assert version == 2 and torch.equal(state["embed"], make_state(2)["embed"])
    assert reader.stats()[mn.ACTOR_REDIS_CHUNK_BYTES] == before  # no chunk read
    assert reader.stats()[mn.ACTOR_WEIGHT_REDIS_FALLBACKS] == 1


def test_bytes_after_the_commit_are_waited_for_elsewhere_and_stored_on_retry(
    redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = WeightReader(redis_client, RUN, host_cache=HostCache(tmp_path))
    local.register_node()
    writer = WeightWriter(redis_client, RUN, host_cache_dir=str(tmp_path), keyframe_every=4)
    writer.publish(1, make_state(1))
    second = make_state(1)
    second["embed"][3] += 1  # a small change: a delta in Redis
    real_write = writer_module.write_chunks

    def outage(*args, **kwargs):
        raise redis.ConnectionError("Redis went away")

    monkeypatch.setattr(writer_module, "write_chunks", outage)
    with pytest.raises(redis.ConnectionError):
        writer.publish(2, second)
    assert writer.manifest(2)["redis_bytes"] == "pending"  # committed, bytes not stored
    # The node's actor has it at once; one on another node waits for the bytes.
    assert torch.equal(local.fetch(2)[1]["embed"], second["embed"])
    remote = WeightReader(redis_client, RUN)
    got: dict[str, object] = {}
    waiting = threading.Thread(target=lambda: got.update(fetched=remote.fetch(2)))
    waiting.start()
    waiting.join(timeout=0.5)
    assert waiting.is_alive()  # still waiting for the bytes
    monkeypatch.setattr(writer_module, "write_chunks", real_write)
    writer.publish(2, second)  # the retry stores the bytes, publishes nothing new
    waiting.join(timeout=30)
    version, state = got["fetched"]
    assert version == 2 and torch.equal(state["embed"], second["embed"])
    assert writer.manifest(2)["redis_bytes"] == "stored" and writer.latest_version() == 2
    assert writer.manifest(2)["kind"] == "delta"  # against version 1, as without the plane
    assert local.stats()[mn.ACTOR_REDIS_CHUNK_BYTES] == 0


def test_the_writer_keeps_its_delta_base_in_place(redis_client: redis.Redis) -> None:
    writer = WeightWriter(redis_client, RUN, keyframe_every=3)
    states = [make_state(0)]
    for _ in range(4):
        nxt = {name: t.clone() for name, t in states[-1].items()}
        nxt["embed"][7] += 1
        states.append(nxt)
    pointers = None
    for version, state in enumerate(states):
        writer.publish(version, state)  # versions 1, 2: deltas; 3: a keyframe
        held = writer._published
        assert held is not None and held.version == version
        assert all(torch.equal(held.state[n], t) for n, t in state.items())
        assert all(held.state[n].data_ptr() != t.data_ptr() for n, t in state.items())
        now = {n: t.data_ptr() for n, t in held.state.items()}
        assert pointers is None or now == pointers  # updated in place, never copied anew
        pointers = now
    assert [writer.manifest(v)["kind"] for v in range(1, 5)] == ["delta", "delta", "full", "delta"]


def test_apply_delta_in_place_writes_into_the_base() -> None:
    base = {"a": torch.zeros(1000), "b": torch.ones(10), "c": torch.full((4,), 2.0)}
    new = {"a": base["a"].clone(), "b": torch.arange(10.0), "c": base["c"].clone()}
    new["a"][[3, 500]] = 7.0
    blob, encoding = encode_delta(base, new)
    assert encoding == {"a": "sparse", "b": "dense", "c": "same"}
    copied = apply_delta(1, base, blob, encoding)
    assert torch.equal(base["a"], torch.zeros(1000))  # untouched
    pointers = {n: t.data_ptr() for n, t in base.items()}
    in_place = apply_delta(1, base, blob, encoding, in_place=True)
    for name, t in in_place.items():
        assert torch.equal(t, new[name]) and torch.equal(copied[name], new[name])
        assert t.data_ptr() == pointers[name]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("threads", [1, 4])
def test_the_threaded_finite_check_finds_one_bad_value_in_a_split_tensor(
    monkeypatch: pytest.MonkeyPatch, bad: float, threads: int
) -> None:
    monkeypatch.setattr(format_module, "FINITE_BLOCK", 1000)
    state = {"ok": torch.randn(5000), "big": torch.randn(10, 999).to(torch.bfloat16)}
    check_finite(0, state, threads)
    state["big"][9, 998] = bad  # in the last block
    with pytest.raises(WeightsNonFinite, match="tensor big has 1 non-finite"):
        check_finite(0, state, threads)


def test_config_and_recipe_carry_the_plane(redis_server: RedisServer, tmp_path: Path) -> None:
    cfg = RedisConfig(url=redis_server.url, host_cache_dir=str(tmp_path))
    assert cfg.publish_to_host_cache is True
    writer = WeightWriter.from_config(cfg, RUN)
    assert writer.node_plane is not None and writer.node_plane.root == str(tmp_path)
    again = WeightWriter.from_recipe(writer.recipe())
    assert again.node_plane is not None and again.node_plane.root == str(tmp_path)
    assert WeightReader.from_recipe(writer.recipe()).host_cache is None
    off = WeightWriter.from_config(replace(cfg, publish_to_host_cache=False), RUN)
    assert off.node_plane is None and WeightWriter.from_recipe(off.recipe()).node_plane is None
    with pytest.raises(ValueError, match="absolute path"):
        RedisConfig(host_cache_dir="relative/shm")
    assert os.path.isabs(RedisConfig().host_cache_dir)


def test_a_retry_after_redis_lost_the_commit_publishes_the_version_anew(
    redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    WeightReader(redis_client, RUN, host_cache=HostCache(tmp_path)).register_node()
    writer = WeightWriter(redis_client, RUN, host_cache_dir=str(tmp_path))
    real_write = writer_module.write_chunks

    def outage(*args, **kwargs):
        raise redis.ConnectionError("Redis went away")

    monkeypatch.setattr(writer_module, "write_chunks", outage)
    with pytest.raises(redis.ConnectionError):
        writer.publish(1, make_state(1))
    redis_client.flushdb()  # it came back empty
    WeightReader(redis_client, RUN, host_cache=HostCache(tmp_path)).register_node()
    monkeypatch.setattr(writer_module, "write_chunks", real_write)
    writer.publish(1, make_state(1))
    assert writer.latest_version() == 1 and writer.manifest(1)["redis_bytes"] == "stored"
    version, state = WeightReader(redis_client, RUN).fetch(1)
    assert version == 1 and torch.equal(state["embed"], make_state(1)["embed"])


def test_deltas_leave_a_version_the_reader_handed_out_untouched(
    redis_client: redis.Redis,
) -> None:
    writer = WeightWriter(redis_client, RUN, keyframe_every=10)
    states = [make_state(0)]
    for changed in ("embed", "norm", "embed"):  # a delta changes what the one before left
        nxt = {name: t.clone() for name, t in states[-1].items()}
        nxt[changed][len(states)] += 1
        states.append(nxt)
    writer.publish(0, states[0])
    reader = WeightReader(redis_client, RUN)
    _, handed_out = reader.fetch(0)
    kept = {name: t.clone() for name, t in handed_out.items()}
    for version in (1, 2, 3):
        writer.publish(version, states[version])
    _, latest = reader.fetch(3)  # two deltas from the version handed out
    assert all(torch.equal(handed_out[n], kept[n]) for n in kept)
    assert all(torch.equal(latest[n], states[3][n]) for n in kept)
    fresh = WeightReader(redis_client, RUN)  # from the keyframe, the deltas in place
    assert all(torch.equal(fresh.fetch(3)[1][n], states[3][n]) for n in kept)

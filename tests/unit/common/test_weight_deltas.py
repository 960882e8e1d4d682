"""Deltas, keyframes, the full-weights digest and non-finite refusal, against a real Redis."""

from __future__ import annotations

import json

import pytest
import redis
import safetensors.torch
import torch

import common.weights.publish.writer as writer_module
from common.weights.fetch.feed import fetch_newer
from common.weights.fetch.reader import WeightReader
from common.weights.fetch.watcher import VersionWatcher
from common.weights.format import WeightsCorrupt, WeightsError, WeightsNonFinite, weights_digest
from common.weights.keys import weights_chunk_key, weights_manifest_key, weights_versions_key
from common.weights.manifest import digest_of_digests, sha256_of
from common.weights.publish.writer import WeightWriter, encode_delta

RUN = "delta-run"


def base_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "b": torch.randn(64, generator=g).to(torch.bfloat16),
        "steps": torch.tensor(0, dtype=torch.int64),
    }


def step(state: dict[str, torch.Tensor], seed: int, frac: float = 0.01) -> dict[str, torch.Tensor]:
    """A new version where about ``frac`` of ``w``'s elements changed (``b`` untouched)."""
    g = torch.Generator().manual_seed(seed)
    w = state["w"].clone()
    changed = torch.rand(w.shape, generator=g) < frac
    w[changed] = w[changed] + 0.5
    return {"w": w, "b": state["b"].clone(), "steps": state["steps"] + 1}


def versions(n: int) -> list[dict[str, torch.Tensor]]:
    out = [base_state()]
    for i in range(1, n):
        out.append(step(out[-1], i))
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def publisher(client: redis.Redis, keyframe_every: int = 4, retention: int = 3) -> WeightWriter:
    return WeightWriter(
        client, RUN, chunk_bytes=1024, retention=retention, keyframe_every=keyframe_every
    )


def test_deltas_round_trip_bit_exact_and_small(redis_client: redis.Redis) -> None:
    pub = publisher(redis_client, keyframe_every=4, retention=10)
    reader = WeightReader(redis_client, RUN, chunk_bytes=1024)
    states = versions(6)
    sizes = {}
    for v, sd in enumerate(states, start=1):
        pub.publish(v, sd)
        sizes[v] = pub.last_publish_bytes
        got_v, got = reader.fetch(v)
        assert got_v == v and same(got, sd), v
    kinds = [reader.manifest(v)["kind"] for v in range(1, 7)]
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta"]
    manifest = reader.manifest(2)
    assert manifest["base"] == 1 and manifest["keyframe"] == 1
    assert manifest["encoding"] == {"w": "sparse", "b": "same", "steps": "dense"}
    assert manifest["dtype"] == "bfloat16"
    assert manifest["weights_sha256"] == weights_digest(states[1])
    assert sizes[2] < 0.2 * sizes[1]


def test_late_reader_joins_from_the_keyframe(redis_client: redis.Redis) -> None:
    pub = publisher(redis_client, keyframe_every=4, retention=10)
    states = versions(7)
    for v, sd in enumerate(states, start=1):
        pub.publish(v, sd)
    # Fresh readers hold nothing: v3 is keyframe 1 + deltas 2, 3; v7 is keyframe 5 + 6, 7.
    for v in (3, 7, 5):
        late = WeightReader(redis_client, RUN, chunk_bytes=1024)
        assert same(late.fetch(v)[1], states[v - 1]), v


def test_dense_deltas_are_written_full(redis_client: redis.Redis) -> None:
    pub = publisher(redis_client, keyframe_every=4)
    g = torch.Generator().manual_seed(1)
    for v in (1, 2):  # every element changes: a delta would not be smaller
        pub.publish(v, {"w": torch.randn(32, 32, generator=g)})
    assert pub.manifest(2)["kind"] == "full"


def test_retention_keeps_the_delta_chain(redis_client: redis.Redis) -> None:
    pub = publisher(redis_client, keyframe_every=4, retention=1)
    states = versions(7)
    for v, sd in enumerate(states, start=1):
        pub.publish(v, sd)
    # Version 7 is a delta on 6 on keyframe 5: those stay, 1-4 are gone.
    kept = [int(v) for v in redis_client.zrange(weights_versions_key(RUN), 0, -1)]
    assert kept == [5, 6, 7]
    late = WeightReader(redis_client, RUN, chunk_bytes=1024)
    assert same(late.fetch(7)[1], states[6])


def rewrite_delta(client: redis.Redis, version: int, blob: dict[str, torch.Tensor]) -> None:
    """Replace a delta's bytes with ``blob``, fixing the chunk checksums so only the weights
    digest can tell (a wrong delta, not a corrupted transfer)."""
    key = weights_manifest_key(RUN, version)
    manifest = json.loads(client.get(key))
    for i in range(manifest["num_chunks"]):
        client.delete(weights_chunk_key(RUN, version, i))
    data = safetensors.torch.save(blob)
    chunks = [data[i : i + 1024] for i in range(0, len(data), 1024)]
    for i, chunk in enumerate(chunks):
        client.set(weights_chunk_key(RUN, version, i), chunk)
    digests = [sha256_of(memoryview(c)).hex() for c in chunks]
    manifest |= {
        "num_chunks": len(chunks),
        "chunk_sha256": digests,
        "chunks_sha256": digest_of_digests(digests),
        "total_bytes": len(data),
    }
    client.set(key, json.dumps(manifest))


def tamper_wrong_delta(client: redis.Redis, states: list[dict[str, torch.Tensor]]) -> None:
    wrong = step(states[0], seed=99)  # a well-formed delta to the wrong weights
    blob, encoding = encode_delta(states[0], wrong)
    assert encoding["w"] == "sparse"
    rewrite_delta(client, 2, blob)


def tamper_missing_delta(client: redis.Redis, states: list[dict[str, torch.Tensor]]) -> None:
    client.delete(weights_chunk_key(RUN, 2, 0))


@pytest.mark.parametrize("tamper", [tamper_wrong_delta, tamper_missing_delta])
def test_bad_delta_is_refused_and_actor_keeps_weights(redis_client: redis.Redis, tamper) -> None:
    pub = publisher(redis_client, keyframe_every=10)
    actor = WeightReader(redis_client, RUN, chunk_bytes=1024)
    watcher = VersionWatcher.of_store(actor, poll_interval_s=0.05)
    states = versions(4)
    pub.publish(1, states[0])
    version, held, _ = fetch_newer(actor, watcher, -1, timeout_s=2.0)
    assert version == 1

    pub.publish(2, states[1])
    tamper(redis_client, states)
    assert fetch_newer(actor, watcher, version, timeout_s=2.0) is None
    with pytest.raises(WeightsCorrupt):
        actor.fetch(2)
    assert same(held, states[0])
    # Deltas built on the bad one cannot be applied either: refused, weights kept.
    pub.publish(3, states[2])
    with pytest.raises(WeightsCorrupt):
        actor.fetch(3)
    assert same(actor.fetch(1)[1], states[0])


def test_non_finite_version_is_never_published(redis_client: redis.Redis) -> None:
    pub = publisher(redis_client)
    pub.publish(1, base_state())
    bad = base_state()
    bad["w"][3, 5] = float("nan")
    with pytest.raises(WeightsNonFinite, match="w has 1 non-finite"):
        pub.publish(2, bad)
    bad["w"][3, 5] = float("inf")
    with pytest.raises(WeightsNonFinite):
        pub.publish(2, bad)
    assert pub.latest_version() == 1
    assert pub.manifest(2) is None and not redis_client.exists(weights_chunk_key(RUN, 2, 0))


def publish_unchecked(monkeypatch, store: WeightWriter, version: int, sd) -> None:
    """Publish bypassing the writer's finite check (a broken or foreign publisher)."""
    with monkeypatch.context() as m:
        m.setattr(writer_module, "check_finite", lambda version, state, threads=1: None)
        store.publish(version, sd)


@pytest.mark.parametrize("keyframe_every", [1, 10], ids=["full", "delta"])
def test_actor_refuses_non_finite_and_keeps_weights(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, keyframe_every: int
) -> None:
    pub = publisher(redis_client, keyframe_every=keyframe_every)
    actor = WeightReader(redis_client, RUN, chunk_bytes=1024)
    watcher = VersionWatcher.of_store(actor, poll_interval_s=0.05)
    states = versions(3)
    pub.publish(1, states[0])
    version, held, _ = fetch_newer(actor, watcher, -1, timeout_s=2.0)

    bad = {k: v.clone() for k, v in states[1].items()}
    bad["w"][0, 0] = float("nan")
    publish_unchecked(monkeypatch, pub, 2, bad)
    assert pub.manifest(2)["kind"] == ("delta" if keyframe_every > 1 else "full")
    assert fetch_newer(actor, watcher, version, timeout_s=2.0) is None
    with pytest.raises(WeightsNonFinite):
        actor.fetch(2)
    assert same(held, states[0])


def test_unknown_manifest_format_is_refused(redis_client: redis.Redis) -> None:
    pub = publisher(redis_client)
    pub.publish(1, base_state())
    key = weights_manifest_key(RUN, 1)
    manifest = json.loads(redis_client.get(key))
    manifest["format"] = 2
    redis_client.set(key, json.dumps(manifest))
    with pytest.raises(WeightsError, match="format 2"):
        WeightReader(redis_client, RUN).fetch(1)

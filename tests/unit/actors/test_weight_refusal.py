"""An actor refuses a tampered weights version and keeps generating on the weights it has."""

from __future__ import annotations

import json

import pytest
import redis
import torch

from common.weights.fetch.feed import fetch_newer
from common.weights.fetch.reader import WeightReader
from common.weights.fetch.watcher import VersionWatcher
from common.weights.keys import weights_chunk_key, weights_manifest_key
from common.weights.publish.writer import WeightWriter

RUN = "tamper-run"


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 32, generator=g), "b": torch.randn(32, generator=g)}


def tamper_shape(client: redis.Redis, version: int) -> None:
    key = weights_manifest_key(RUN, version)
    manifest = json.loads(client.get(key))
    manifest["tensors"]["w"]["shape"] = [16, 64]
    client.set(key, json.dumps(manifest))


def tamper_bytes(client: redis.Redis, version: int) -> None:
    key = weights_chunk_key(RUN, version, 0)
    chunk = bytearray(client.get(key))
    chunk[-1] ^= 0xFF  # one bit pattern in the last tensor's data
    client.set(key, bytes(chunk))


@pytest.mark.parametrize("tamper", [tamper_shape, tamper_bytes], ids=["shape", "checksum"])
def test_tampered_version_is_refused_and_current_weights_kept(redis_client, tamper) -> None:
    store = WeightWriter(redis_client, RUN, chunk_bytes=1024)
    reader = WeightReader.from_recipe(store.recipe())
    store.publish(1, state(1))
    watcher = VersionWatcher.of_store(reader, last_seen=None, poll_interval_s=0.05)
    version, weights, _ = fetch_newer(reader, watcher, -1, timeout_s=2.0)
    assert version == 1

    store.publish(2, state(2))
    tamper(redis_client, 2)
    assert fetch_newer(reader, watcher, version, timeout_s=2.0) is None
    assert torch.equal(weights["w"], state(1)["w"])

    # The next good version is taken as usual.
    store.publish(3, state(3))
    update = fetch_newer(reader, watcher, version, timeout_s=2.0)
    assert update is not None and update[0] == 3
    assert torch.equal(update[1]["w"], state(3)["w"])
    watcher.close()

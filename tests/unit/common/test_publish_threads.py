"""A version hashed and serialised on several threads has the digests and bytes it has on one:
the full-weights digest, the safetensors bytes, each chunk's sha256, and what a reader
verifies."""

import hashlib

import redis
import torch

from common.weights.fetch.reader import WeightReader
from common.weights.format import (
    MAX_PUBLISH_THREADS,
    publish_threads,
    serialize_state_dict,
    weights_digest,
)
from common.weights.publish.writer import WeightWriter, write_chunks


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {f"layer.{i}.weight": torch.randn(64 + i, 33).to(torch.bfloat16) for i in range(9)}
    state["norm.weight"] = torch.randn(7)
    state["steps"] = torch.arange(5)
    return state


def test_threads_are_bounded_by_the_cores() -> None:
    assert 1 <= publish_threads() <= MAX_PUBLISH_THREADS


def test_digest_and_bytes_do_not_depend_on_the_threads() -> None:
    state = _state()
    assert weights_digest(state, threads=1) == weights_digest(state, threads=4)
    one = serialize_state_dict(state, threads=1)
    assert bytes(one) == bytes(serialize_state_dict(state, threads=4))


def test_chunk_digests_do_not_depend_on_the_threads(redis_client: redis.Redis) -> None:
    data = bytes(serialize_state_dict(_state()))
    _, one = write_chunks(redis_client, "t", 1, data, 1000, 60, threads=1)
    keys, many = write_chunks(redis_client, "t", 2, data, 1000, 60, threads=4)
    assert one == many
    assert many == [hashlib.sha256(redis_client.get(k)).hexdigest() for k in keys]


def test_a_version_published_on_several_threads_fetches_verified(
    redis_client: redis.Redis,
) -> None:
    state = _state()
    writer = WeightWriter(redis_client, "threads", chunk_bytes=1024)
    writer.threads = 4
    writer.publish(0, state)
    _, fetched = WeightReader(redis_client, "threads").fetch(0)
    assert weights_digest(fetched) == weights_digest(state, threads=1)
    assert all(torch.equal(fetched[n], t) for n, t in state.items())


def test_a_full_version_goes_out_without_a_whole_copy_of_its_bytes(
    redis_client: redis.Redis, monkeypatch
) -> None:
    """Python-side allocations while a 20 MB version is written stay far under its size: it is
    serialised chunk by chunk, and at most ``FLUSH_BYTES`` of chunks wait for Redis."""
    import tracemalloc

    import common.weights.publish.writer as writer_module

    monkeypatch.setattr(writer_module, "FLUSH_BYTES", 4 * 2**20)
    torch.manual_seed(1)
    state = {"big": torch.randn(5_000_000), "small": torch.randn(33)}  # tensors: not traced
    writer = WeightWriter(redis_client, "streamed", chunk_bytes=2**20, keyframe_every=1)
    tracemalloc.start()
    try:
        writer.publish(0, state)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert writer.last_publish_bytes > 20_000_000
    assert peak < 10_000_000, peak
    _, fetched = WeightReader(redis_client, "streamed").fetch(0)
    assert all(torch.equal(fetched[n], t) for n, t in state.items())


def test_chunks_held_for_hashing_stay_under_the_bound(
    redis_client: redis.Redis, monkeypatch
) -> None:
    """Hashing slower than the chunks come holds under ``FLUSH_BYTES`` plus one chunk for the
    hashing threads: the writer waits for the oldest digests instead of taking more chunks."""
    import threading
    import time

    import common.weights.publish.writer as writer_module
    from common.weights.manifest import sha256_of

    size, bound, count = 1000, 4000, 40
    monkeypatch.setattr(writer_module, "FLUSH_BYTES", bound)
    lock = threading.Lock()
    hashed = 0  # bytes whose hash is done

    def slow_sha256(chunk) -> bytes:
        nonlocal hashed
        time.sleep(0.005)
        digest = sha256_of(chunk)
        with lock:
            hashed += len(chunk)
        return digest

    monkeypatch.setattr(writer_module, "sha256_of", slow_sha256)
    taken, held = 0, []  # bytes taken by the writer; bytes not yet hashed as each chunk is taken

    def chunks():
        nonlocal taken
        for i in range(count):
            taken += size
            with lock:
                held.append(taken - hashed)
            yield bytearray(bytes([i]) * size)

    keys, digests = write_chunks(redis_client, "t", 1, chunks(), size, 60, threads=2)
    assert max(held) < bound + size, held
    assert digests == [hashlib.sha256(bytes([i]) * size).hexdigest() for i in range(count)]
    assert [redis_client.get(k) for k in keys] == [bytes([i]) * size for i in range(count)]

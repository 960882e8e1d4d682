"""One fetch per host: real processes share a version through the host cache, Redis sends it
once, and no process ever reads a half-written cache file. A reader trusts only directories
and files of its own user that no one else may write, never follows a symlink, and hashes what
it maps: a refused copy is counted and the version fetched from Redis."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import stat
import time
from pathlib import Path

import pytest
import redis
import torch

from common import metric_names as mn
from common.weights.fetch.reader import WeightReader
from common.weights.format import serialize_state_dict, tensors_from_safetensors, weights_digest
from common.weights.host_cache import CacheRefused, HostCache
from common.weights.publish.writer import WeightWriter
from ops.redis_server import RedisServer

RUN = "cache-run"
CHUNK = 64 * 1024


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(256, 256, generator=g).to(torch.bfloat16) for i in range(8)}


def fetcher(url: str, root: str, version: int, barrier, results) -> None:
    torch.set_num_threads(1)
    store = WeightReader(
        redis.Redis.from_url(url), RUN, chunk_bytes=CHUNK, host_cache=HostCache(root)
    )
    barrier.wait()
    got, sd = store.fetch(version)
    results.put((got, weights_digest(sd)))


def egress(client: redis.Redis) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


def fetch_in_processes(url: str, root: Path, version: int, n: int) -> list[tuple[int, str]]:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=fetcher, args=(url, str(root), version, barrier, results))
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    out = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return out


def test_four_processes_on_one_host_fetch_a_version_once(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    pub = WeightWriter(redis_client, RUN, chunk_bytes=CHUNK, keyframe_every=4)
    v1 = state(1)
    v2 = {k: t.clone() for k, t in v1.items()}
    v2["w0"][0, :10] += 1  # a small delta
    pub.publish(1, v1)
    full_bytes = pub.last_publish_bytes
    before = egress(redis_client)
    got = fetch_in_processes(redis_server.url, tmp_path, 1, 4)
    sent = egress(redis_client) - before
    assert got == [(1, weights_digest(v1))] * 4
    # One copy of the version (plus manifests and lock-step chatter), not four.
    assert full_bytes < sent < 1.3 * full_bytes, (sent, full_bytes)

    pub.publish(2, v2)
    assert pub.manifest(2)["kind"] == "delta"
    got = fetch_in_processes(redis_server.url, tmp_path, 2, 4)
    assert got == [(2, weights_digest(v2))] * 4  # late joiners: keyframe 1 (cached) + delta


def content(version: int) -> bytes:
    return hashlib.sha256(str(version).encode()).digest() * (4 * 2**20 // 32)


class InPlaceCache(HostCache):
    """Negative control: writes the final file in place, piece by piece (no temp + rename)."""

    def put(self, run_id: str, version: int, digest: str, data: torch.Tensor | bytes) -> bool:
        final = self.path(run_id, version, digest)
        for directory in (final.parent.parent, final.parent):  # the checks a reader makes
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(final, "wb") as f:
            for i in range(0, len(data), 256 * 1024):
                f.write(data[i : i + 256 * 1024])
                f.flush()
                time.sleep(0.002)
        return True


def cache_writer(root: str, versions: int, in_place: bool, start) -> None:
    cache = (InPlaceCache if in_place else HostCache)(root, keep=versions)
    start.wait(timeout=120)  # the readers are spinning: no version is written before they look
    for v in range(versions):
        data = content(v)
        cache.put(RUN, v, hashlib.sha256(data).hexdigest(), data)


def cache_reader(root: str, versions: int, results, start) -> None:
    """Reads every version as early as its file can be seen; reports how many were torn."""
    cache = HostCache(root, keep=versions)
    torn = 0
    start.wait(timeout=120)
    for v in range(versions):
        want = content(v)
        digest = hashlib.sha256(want).hexdigest()
        while (buf := cache.get(RUN, v, digest)) is None:
            pass  # spin: catch the file as early as it can be seen
        torn += bytes(buf.numpy()) != want
    results.put(torn)


def race(root: Path, versions: int, in_place: bool) -> list[int]:
    """Torn reads seen by each of 2 reader processes while a writer process puts versions."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # Spawned processes take seconds to import torch; without this the writer could finish
    # before a reader looks, and the negative control would see no torn read.
    start = ctx.Barrier(3)
    readers = [
        ctx.Process(target=cache_reader, args=(str(root), versions, results, start))
        for _ in range(2)
    ]
    for p in readers:
        p.start()
    writer = ctx.Process(target=cache_writer, args=(str(root), versions, in_place, start))
    writer.start()
    writer.join(timeout=120)
    assert writer.exitcode == 0
    torn = [results.get(timeout=120) for _ in readers]
    for p in readers:
        p.join(timeout=30)
        assert p.exitcode == 0
    return torn


def test_shared_copy_is_never_read_half_written(tmp_path: Path) -> None:
    versions = 12
    assert race(tmp_path / "cache", versions, in_place=False) == [0, 0]
    # Negative control: the same readers catch a writer that writes the file in place.
    assert sum(race(tmp_path / "in-place", 4, in_place=True)) > 0
    root = tmp_path / "cache"
    # No temp file is left behind, and no other name is ever visible.
    names = {p.name for p in HostCache(root).root.rglob("*")}
    assert not [n for n in names if n.endswith(".tmp")]


def test_remove_run_deletes_only_that_runs_copies(tmp_path: Path) -> None:
    cache = HostCache(tmp_path)
    data = torch.arange(64, dtype=torch.uint8)
    digest = "ab" * 32
    cache.put("run-a", 1, digest, data)
    cache.put("run-b", 1, digest, data)
    with cache.lock("run-a", 2):
        pass
    assert cache.remove_run("run-a") == 64
    assert cache.get("run-a", 1, digest) is None
    assert cache.get("run-b", 1, digest) is not None
    assert cache.remove_run("run-a") == 0  # nothing left: no error


# ----------------------------------------------------------------- what a reader trusts

TRUST = "trust-run"


def ones() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(4, 4)}  # sums to 16


def cached_reader(url: str, root: Path) -> WeightReader:
    return WeightReader(redis.Redis.from_url(url), TRUST, host_cache=HostCache(root))


def published(redis_client: redis.Redis) -> str:
    """Version 1 (``ones``) published; its weights_sha256."""
    WeightWriter(redis_client, TRUST).publish(1, ones())
    return WeightReader(redis_client, TRUST).checked_manifest(1)["weights_sha256"]


def test_the_cache_creates_its_directories_and_files_for_this_user_alone(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    digest = published(redis_client)
    reader = cached_reader(redis_server.url, tmp_path)
    assert reader.fetch(1)[1]["w"].sum() == 16
    cache = HostCache(tmp_path)
    file = cache.path(TRUST, 1, digest)
    for directory in (cache.root, file.parent):
        st = directory.lstat()
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.getuid()
    assert stat.S_IMODE(file.lstat().st_mode) == 0o600 and reader.cache_refused == 0


def test_a_cache_directory_others_may_write_is_not_used(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    published(redis_client)
    root = HostCache(tmp_path).root
    root.mkdir()
    root.chmod(0o777)  # pre-created by someone else, open to every user
    reader = cached_reader(redis_server.url, tmp_path)
    before = egress(redis_client)
    version, state = reader.fetch(1)
    assert version == 1 and state["w"].sum() == 16  # fetched from Redis instead
    assert egress(redis_client) - before > 64  # the bytes did come from Redis
    assert reader.stats()[mn.ACTOR_HOST_CACHE_REFUSED] == 1
    assert list(root.iterdir()) == []  # nothing written into it
    assert stat.S_IMODE(root.lstat().st_mode) == 0o777  # and left as it was
    with pytest.raises(CacheRefused, match="mode 0777"):
        HostCache(tmp_path).put(TRUST, 1, "ab" * 32, b"x")
    # A directory of another user, even 0700, is refused too (needs root to make one).
    if os.getuid() == 0:
        root.chmod(0o700)
        os.chown(root, 12345, 12345)
        with pytest.raises(CacheRefused, match="belongs to uid 12345"):
            HostCache(tmp_path).get(TRUST, 1, "ab" * 32)
    # A symlink in place of the directory (to one of ours, 0700) is not followed.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / root.name).symlink_to(elsewhere)
    with pytest.raises(CacheRefused, match="not a directory"):
        HostCache(linked).get(TRUST, 1, "ab" * 32)


def swap_in(path: Path, state: dict[str, torch.Tensor], mode: int = 0o600) -> None:
    """Replace the file at ``path`` by ``state``'s safetensors bytes (by rename, as an attacker
    or a stray process of this user could)."""
    tmp = path.with_name("swap.tmp")
    tmp.write_bytes(serialize_state_dict(state))
    tmp.chmod(mode)
    os.replace(tmp, path)


def test_a_copy_swapped_under_its_digest_name_is_refused_and_fetched_from_redis(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    digest = published(redis_client)
    assert cached_reader(redis_server.url, tmp_path).fetch(1)[1]["w"].sum() == 16
    path = HostCache(tmp_path).path(TRUST, 1, digest)
    swap_in(path, {"w": torch.full((4, 4), 1000.0)})  # same name, shape and dtype
    # The cache alone serves the swapped bytes: only the reader's hash stands in the way.
    served = tensors_from_safetensors(1, HostCache(tmp_path).get(TRUST, 1, digest))
    assert served["w"].sum() == 16000
    second = cached_reader(redis_server.url, tmp_path)
    version, state = second.fetch(1)
    assert version == 1 and state["w"].sum() == 16
    assert second.cache_refused == 1
    # The fetcher put the verified copy back: the next reader maps it, nothing refused.
    third = cached_reader(redis_server.url, tmp_path)
    assert third.fetch(1)[1]["w"].sum() == 16 and third.cache_refused == 0


@pytest.mark.parametrize("kind", ["symlink", "others_may_write"])
def test_a_symlink_or_a_writable_file_in_place_of_a_copy_is_refused(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path, kind: str
) -> None:
    digest = published(redis_client)
    cache = HostCache(tmp_path)
    path = cache.path(TRUST, 1, digest)
    assert cached_reader(redis_server.url, tmp_path).fetch(1)[1]["w"].sum() == 16
    if kind == "symlink":  # to a copy of the right bytes, even: a link is never followed
        target = tmp_path / "target.safetensors"
        target.write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to(target)
        match = "is a symlink"
    else:
        swap_in(path, ones(), mode=0o666)  # the right bytes, in a file others may write
        match = "mode 0666"
    with pytest.raises(CacheRefused, match=match):
        cache.get(TRUST, 1, digest)
    reader = cached_reader(redis_server.url, tmp_path)
    assert reader.fetch(1)[1]["w"].sum() == 16 and reader.cache_refused == 1
    assert not path.is_symlink() and stat.S_IMODE(path.lstat().st_mode) == 0o600  # replaced


def test_a_write_into_the_cached_file_after_a_hit_leaves_the_weights_as_fetched(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path, monkeypatch
) -> None:
    digest = published(redis_client)
    assert cached_reader(redis_server.url, tmp_path).fetch(1)[1]["w"].sum() == 16  # the fetcher
    reader = cached_reader(redis_server.url, tmp_path)

    def no_redis(*args: object) -> None:
        raise AssertionError("a host-cache hit reads nothing from Redis")

    monkeypatch.setattr(reader, "_build", no_redis)
    weights = reader.fetch(1)[1]["w"]  # a hit, hashed and handed out
    # A process of the same user writes into the same inode (no rename, no new file).
    path = HostCache(tmp_path).path(TRUST, 1, digest)
    inode = path.stat().st_ino
    with open(path, "r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header)
        f.write(torch.full((4, 4), 1000.0).numpy().tobytes())
    assert path.stat().st_ino == inode
    served = tensors_from_safetensors(1, HostCache(tmp_path).get(TRUST, 1, digest))
    assert served["w"].sum() == 16000  # the file did change
    assert weights.sum() == 16 and torch.equal(weights, torch.ones(4, 4))  # a private copy


def test_a_cached_file_that_changes_size_while_read_is_refused(tmp_path: Path, monkeypatch) -> None:
    cache = HostCache(tmp_path)
    digest = "ab" * 32
    cache.put(RUN, 1, digest, bytes(range(64)))
    real_preadv = os.preadv

    def truncating_preadv(fd: int, buffers: list, offset: int) -> int:
        cache.path(RUN, 1, digest).write_bytes(b"x" * 10)  # truncated in place by another writer
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", truncating_preadv)
    with pytest.raises(CacheRefused, match="shrank while it was read"):
        cache.get(RUN, 1, digest)

"""The collective weights path with real processes, a real Redis and a gloo weights group on
loopback: a learner-side ``CollectiveSender`` in this process (fed by ``send``, or by a real
``Publisher``'s snapshots as in the learner), actors running
``benchmarks.weights_collective.actor_main`` (a ``CollectiveFeed`` each) in spawned processes."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import redis
import torch

from benchmarks.weights_collective import Actors, wait_members
from common.model import Transformer
from common.tokenizer import CharTokenizer
from common.weights.collective import (
    WIRE_DTYPE,
    bucket_ranges,
    bucket_sha256,
    pack,
    read_manifest,
    wire_layout,
)
from common.weights.fetch.reader import WeightReader
from common.weights.format import WeightsError, weights_digest
from common.weights.manifest import digest_of_digests
from common.weights.publish.collective_sender import CollectiveSender
from common.weights.publish.publisher import Publisher
from common.weights.publish.upload import Snapshot
from common.weights.publish.writer import WeightWriter
from ops.redis_server import find_free_port
from testing.models import random_model
from testing.publishing import bf16_publisher

pytestmark = pytest.mark.integration

RUN = "collective-test"
# timeout_s: how long a member left waiting on a gone peer waits before it joins again.
FAST = {"digest": True, "join_timeout_s": 5.0, "rejoin_s": 0.5, "idle_timeout_s": 10.0}
FAST |= {"timeout_s": 10.0, "log_level": "INFO"}  # joins and epochs in the report on failure


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 33, generator=g),
        "norm.weight": torch.randn(1000, generator=g),
        "steps": torch.tensor(seed),
        "ids": torch.arange(10, dtype=torch.int32) * seed,
    }


def wire(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(WIRE_DTYPE) if v.is_floating_point() else v for k, v in state.items()}


def sender_at(redis_client, cls=CollectiveSender) -> CollectiveSender:
    address = f"127.0.0.1:{find_free_port()}"
    # 1 KiB buckets: each version takes several, so reassembly across buckets is exercised.
    return cls(redis_client, RUN, address, bucket_bytes=1024, heartbeat_s=0.5, timeout_s=20.0)


def held_by_actor(actors: Actors, count: int, timeout_s: float = 60.0) -> dict[int, tuple]:
    return {h[1]: h for h in (actors.get("held", timeout_s) for _ in range(count))}


def wait_stat(actors: Actors, index: int, key: str, at_least: int, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while (stats := actors.stats(index))[key] < at_least:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    return stats


def test_two_actors_receive_each_sent_version(redis_client, redis_server):
    with sender_at(redis_client) as sender:
        actors = Actors(2, redis_server.url, RUN, [sender.address] * 2, FAST)
        try:
            wait_members(sender, 2, 60)
            for version in (1, 2):
                state = make_state(version)
                sender.send(version, state)
                held = held_by_actor(actors, 2)
                assert sorted(held) == [0, 1]
                for h in held.values():
                    assert h[2] == version
                    assert h[5] == weights_digest(wire(state))  # equal to the sent state in bf16
                    assert (h[6]["collective"], h[6]["redis"], h[6]["refused"]) == (version, 0, 0)
            assert sender.stats()["versions_sent"] == 2
            with pytest.raises(WeightsError, match="versions only grow"):
                sender.send(2, make_state(2))
        finally:
            actors.close()


class TamperingSender(CollectiveSender):
    """Writes a wrong digest for bucket 1 of version 2 (the bucket list hashed consistently, so
    only the receivers' comparison with their own hashes can catch it)."""

    def _manifest(self, version, layout, digests):
        manifest = super()._manifest(version, layout, digests)
        if version == 2:
            listed = list(manifest["bucket_sha256"])
            listed[1] = "0" * 64
            manifest |= {"bucket_sha256": listed, "buckets_sha256": digest_of_digests(listed)}
        return manifest


def test_a_version_that_fails_its_manifest_is_refused(redis_client, redis_server):
    with sender_at(redis_client, TamperingSender) as sender:
        actors = Actors(2, redis_server.url, RUN, [sender.address] * 2, FAST)
        try:
            wait_members(sender, 2, 60)
            sender.send(1, make_state(1))
            assert all(h[2] == 1 for h in held_by_actor(actors, 2).values())
            sender.send(2, make_state(2))
            assert sender.flush(60)
            sender.send(3, make_state(3))
            held = held_by_actor(actors, 2)  # the next version they hold is 3, never 2
            for h in held.values():
                assert h[2] == 3 and h[5] == weights_digest(wire(make_state(3)))
                assert (h[6]["collective"], h[6]["refused"]) == (2, 1)
            # A NaN: the sender's manifest refuses the version, the actors keep 3.
            nan = make_state(4)
            nan["norm.weight"][7] = float("nan")
            sender.send(4, nan)
            assert sender.flush(60)
            sender.send(5, make_state(5))
            for h in held_by_actor(actors, 2).values():
                assert h[2] == 5 and (h[6]["collective"], h[6]["refused"]) == (3, 2)
            assert sender.stats()["refused"] == 1
        finally:
            actors.close()


def test_a_redis_actor_and_a_group_actor_serve_one_run(redis_client, redis_server):
    writer = WeightWriter(redis_client, RUN, retention=2)
    sender = sender_at(redis_client)
    options = {**FAST, "rejoin_s": 60.0}  # after the learner leaves: Redis, no rejoin meanwhile
    actors = Actors(2, redis_server.url, RUN, [sender.address, None], options)
    try:
        wait_members(sender, 1, 60)
        wait_stat(actors, 0, "member", 1)
        state = wire(make_state(1))  # published in bf16: both paths carry the same bytes
        sender.send(1, state)
        writer.publish(1, state)
        held = held_by_actor(actors, 2)
        for h in held.values():
            assert h[2] == 1 and h[5] == weights_digest(state)
        assert (held[0][6]["collective"], held[0][6]["redis"]) == (1, 0)
        assert (held[1][6]["collective"], held[1][6]["redis"]) == (0, 1)

        sender.close()  # the learner leaves the group: the group actor falls back to Redis
        state = wire(make_state(2))
        writer.publish(2, state)
        held = held_by_actor(actors, 2)
        for h in held.values():
            assert h[2] == 2 and h[5] == weights_digest(state)
        assert (held[0][6]["collective"], held[0][6]["redis"]) == (1, 1)
    finally:
        actors.close()
        sender.close()


def test_an_actor_that_cannot_join_takes_versions_from_redis(redis_client, redis_server):
    writer = WeightWriter(redis_client, RUN)
    nobody = f"127.0.0.1:{find_free_port()}"  # no sender there
    actors = Actors(1, redis_server.url, RUN, [nobody], {**FAST, "join_timeout_s": 1.0})
    try:
        state = make_state(1)
        writer.publish(1, state)
        (h,) = held_by_actor(actors, 1).values()
        assert h[2] == 1 and h[5] == weights_digest(state)
        assert (h[6]["redis"], h[6]["collective"], h[6]["member"]) == (1, 0, 0)
        wait_stat(actors, 0, "join_failures", 1)
    finally:
        actors.close()


def test_the_group_goes_on_when_an_actor_is_killed(redis_client, redis_server):
    with sender_at(redis_client) as sender:
        actors = Actors(2, redis_server.url, RUN, [sender.address] * 2, FAST)
        try:
            wait_members(sender, 2, 60)
            sender.send(1, make_state(1))
            assert all(h[2] == 1 for h in held_by_actor(actors, 2).values())
            actors.kill(1)
            for version in (2, 3):
                sender.send(version, make_state(version))
                (h,) = held_by_actor(actors, 1).values()
                assert h[1] == 0 and h[2] == version
                assert h[5] == weights_digest(wire(make_state(version)))
                assert (h[6]["collective"], h[6]["redis"]) == (version, 0)
            assert sender.stats()["group_losses"] >= 1
            wait_members(sender, 1, 30)
        finally:
            actors.close()


# ------------------------------------------------------- fed by the publisher, as in the learner


def publishing(
    sender: CollectiveSender, store: WeightWriter, **kwargs
) -> tuple[Transformer, Publisher]:
    """A tiny policy and its publisher as the learner wires them: bf16 versions uploaded from
    shared memory, latest wins, each snapshot lent to the sender."""
    m = random_model(16, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    pub = bf16_publisher(
        store, m, CharTokenizer("abc"), latest_wins=True, on_snapshot=sender.take, **kwargs
    )
    return m, pub


def train(m: Transformer) -> str:
    """A step that changes every weight; the digest of the new weights in bf16."""
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p))
    return weights_digest(wire(m.state_dict()))


def test_the_group_broadcasts_the_publishers_snapshot_of_each_version(redis_client, redis_server):
    """The actor holds exactly the bytes Redis serves for each version, broadcast from the
    publisher's shared-memory slot (no copy of the sender's own); a republished version is not
    sent again; with the publisher's Redis unreachable the group still gets the next version."""
    with sender_at(redis_client) as sender:
        actors = Actors(1, redis_server.url, RUN, [sender.address], FAST)
        try:
            wait_members(sender, 1, 60)
            m, pub = publishing(sender, WeightWriter(redis_client, RUN))
            reader = WeightReader(redis_client, RUN)
            for version in (1, 2):
                expected = train(m)
                pub.publish(version)
                (h,) = held_by_actor(actors, 1).values()
                pub.flush()
                assert h[2] == version and h[5] == expected
                assert h[5] == weights_digest(reader.fetch(version)[1])  # what Redis serves
                assert (h[6]["collective"], h[6]["redis"]) == (version, 0)
                assert pub._child is not None and sender._last is not None
                sent = sender._last.payload
                assert sent is not None
                assert any(sent.data_ptr() == slot.data_ptr() for slot in pub._child.slots)
            redis_client.flushdb()  # Redis restarted empty: the republisher puts version 2 back
            pub.publish(2)  # the group has it already
            pub.flush()
            assert sender.flush(30) and sender.stats()["versions_sent"] == 2
            assert sender.error is None
            pub.close()

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]  # closed again: nothing listens there
            stop = threading.Event()
            dead = WeightWriter(redis.Redis(host="127.0.0.1", port=port), RUN)
            m, pub = publishing(sender, dead, should_stop=stop.is_set)
            expected = train(m)
            pub.publish(3)  # the upload retries against nothing; the snapshot is lent at once
            (h,) = held_by_actor(actors, 1).values()
            assert h[2] == 3 and h[5] == expected and pub.published_version == -1
            stop.set()
            pub.close()
        finally:
            actors.close()


class HoldingSender(CollectiveSender):
    """Holds version 1 on the wire: once its layout and first bucket are broadcast (``on_wire``
    set), the other buckets wait for ``go``."""

    def __init__(self, *args, **kwargs) -> None:
        self.on_wire, self.go = threading.Event(), threading.Event()
        super().__init__(*args, **kwargs)

    def _broadcast(self, item) -> None:
        group = self._group
        if item.version != 1 or group is None:
            return super()._broadcast(item)
        real, calls = group.broadcast, []

        def held(tensor: torch.Tensor, timeout_s: float) -> None:
            if len(calls) == 2:
                self.on_wire.set()
                assert self.go.wait(120)
            calls.append(tensor.numel())
            real(tensor, timeout_s)

        group.broadcast = held  # type: ignore[method-assign]
        try:
            super()._broadcast(item)
        finally:
            group.broadcast = real  # type: ignore[method-assign]


def bucket_digests(state: dict[str, torch.Tensor]) -> list[str]:
    """The bucket digests a collective manifest lists for ``state`` sent in 1 KiB buckets."""
    layout = wire_layout(state, 1024)
    payload = pack(state, layout, torch.device("cpu"))
    return [bucket_sha256(payload[a:b]) for a, b in bucket_ranges(payload.numel(), 1024)]


def test_a_snapshot_on_the_wire_is_not_refilled_by_later_versions(redis_client, redis_server):
    """Versions 2 to 6 are published and uploaded while version 1 is half broadcast, enough to
    cycle through every shared-memory slot; then version 1's broadcast goes on, and version 6
    follows (2 to 5 overtaken). The bytes each sent, as its collective manifest hashes them, are
    that version's, equal to what Redis serves. (The actor is the group's member; held that
    long, it may take versions from Redis meanwhile, so its own copies are not compared.)"""
    with sender_at(redis_client, HoldingSender) as sender:
        actors = Actors(1, redis_server.url, RUN, [sender.address], {**FAST, "timeout_s": 120.0})
        try:
            wait_members(sender, 1, 60)
            m, pub = publishing(sender, WeightWriter(redis_client, RUN, retention=10))
            reader = WeightReader(redis_client, RUN)
            expected = {}
            for version in range(1, 7):
                train(m)
                expected[version] = wire({k: t.clone() for k, t in m.state_dict().items()})
                pub.publish(version)
                pub.flush()  # uploaded: its slot is free again for the next version
                if version == 1:
                    assert sender.on_wire.wait(60)
            assert sender.stats()["sent_version"] == -1  # version 1 is still on the wire
            sender.go.set()
            assert sender.flush(120)
            assert sender.skipped == 4 and sender.error is None
            for version in (1, 6):
                manifest = read_manifest(redis_client, RUN, version, 10.0)
                assert manifest is not None
                assert manifest["bucket_sha256"] == bucket_digests(expected[version])
                published = weights_digest(reader.fetch(version)[1])
                assert published == weights_digest(expected[version])
            for version in range(2, 6):
                assert read_manifest(redis_client, RUN, version, 0.0) is None  # never sent
            pub.close()
        finally:
            sender.go.set()
            actors.close()


def test_a_republished_or_older_snapshot_is_released(redis_client):
    """``take``: the version already queued is released and ignored, an older one is released
    and refused; neither stays held."""

    released: list[int] = []

    def lent(version: int) -> Snapshot:
        """Separate tensors, not views into ``payload``: packed on the sender's thread."""
        payload = torch.zeros(0, dtype=torch.uint8)
        return Snapshot(
            version, payload, wire(make_state(version)), lambda: released.append(version)
        )

    with sender_at(redis_client) as sender:
        assert sender.take(lent(5)) is True  # packed on the sender's thread, then released
        assert sender.flush(30) and released == [5]
        assert sender.take(lent(5)) is False and released == [5, 5]
        with pytest.raises(WeightsError, match="versions only grow"):
            sender.take(lent(4))
        assert released == [5, 5, 4]

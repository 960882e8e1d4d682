"""The collective weights path with real processes, a real Redis and a gloo weights group on
loopback: a learner-side ``CollectiveSender`` in this process, actors running
``benchmarks.weights_collective.actor_main`` (a ``CollectiveFeed`` each) in spawned processes."""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks.weights_collective import Actors, wait_members
from common.weights.collective import WIRE_DTYPE
from common.weights.format import WeightsError, weights_digest
from common.weights.manifest import digest_of_digests
from learner.collective_sender import CollectiveSender
from learner.weight_writer import WeightWriter
from ops.redis_server import find_free_port

pytestmark = pytest.mark.integration

RUN = "collective-test"
# timeout_s: how long a member left waiting on a gone peer waits before it joins again.
FAST = {"digest": True, "join_timeout_s": 5.0, "rejoin_s": 0.5, "idle_timeout_s": 10.0}
FAST |= {"timeout_s": 10.0}


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

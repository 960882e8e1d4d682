"""Who the weights group lets in and what happens when its sender fails (issue 39, points 2 and 6),
with a real TCPStore, real gloo groups, a real Redis and, for the admission test, a real actor
process (``benchmarks.weights_collective.actor_main``):

- the store listens on its configured host only, never on every interface;
- a joiner that does not prove the run's secret (kept in Redis) is refused and never admitted;
- a sender error is exported with the learner's metrics (Prometheus, scraped over HTTP);
- a member whose sender failed to deliver a version fetches it from Redis once Redis has been
  ahead of it for ``fallback_s``, counted as ``actor/weight_group_fallbacks``."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

from benchmarks.weights_collective import Actors, wait_members
from common import metric_names as mn
from common.weights.collective import CollectiveError
from common.weights.fetch.collective_feed import CollectiveFeed, CollectiveReceiver
from common.weights.fetch.reader import WeightReader
from common.weights.format import weights_digest
from common.weights.group_join import JOINS, join_proof
from common.weights.publish.collective_sender import CollectiveSender
from common.weights.publish.writer import WeightWriter
from learner.exporter import LearnerExporter
from ops.redis_server import find_free_port
from testing.prometheus import scrape

pytestmark = pytest.mark.integration

RUN = "group-guard-test"
WILDCARDS = {"0.0.0.0", "::"}
FAST = {"digest": True, "join_timeout_s": 5.0, "rejoin_s": 0.5, "idle_timeout_s": 10.0}
FAST |= {"timeout_s": 10.0}


def make_state(seed: int) -> dict[str, torch.Tensor]:
    """A state already in the wire dtype: Redis and the group carry the same bytes."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(40, 33, generator=g).to(torch.bfloat16),
        "steps": torch.tensor(seed),
    }


def listeners(port: int) -> set[str]:
    """The local addresses this process listens on at ``port``."""
    return {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def all_listeners() -> set[tuple[str, int]]:
    """Every (address, port) this process listens on."""
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }


def sender_at(redis_client, cls=CollectiveSender, host="127.0.0.1", **kwargs) -> CollectiveSender:
    address = f"{host}:{find_free_port()}"
    options = {"bucket_bytes": 1024, "heartbeat_s": 0.5, "timeout_s": 20.0} | kwargs
    return cls(redis_client, RUN, address, **options)


def test_the_store_listens_on_its_host_only(redis_client):
    # What the fix is for: a TCPStore of its own listens on every interface.
    port = find_free_port()
    plain = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    try:
        assert listeners(port) & WILDCARDS
    finally:
        del plain
    with sender_at(redis_client) as sender:
        port = int(sender.address.rpartition(":")[2])
        assert listeners(port) == {"127.0.0.1"}
        # It still serves clients on that host.
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        assert client.add(JOINS, 0) == 0


class FailingSender(CollectiveSender):
    """Fails to broadcast version 2 (a sender error: its thread logs it and goes on)."""

    def _broadcast(self, item) -> None:
        if item.version == 2:
            raise RuntimeError("injected: version 2 cannot be sent")
        super()._broadcast(item)


def test_a_joiner_without_the_secret_is_refused_and_receives_nothing(redis_client, redis_server):
    with sender_at(redis_client) as sender:
        port = int(sender.address.rpartition(":")[2])
        raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        silent = raw.add(JOINS, 1)  # a ticket and no proof: never looked at, never answered
        wrong = raw.add(JOINS, 1)  # a ticket and a proof under another secret
        nonce = "0" * 32
        raw.set(f"proof/{wrong}", f"{nonce}.{join_proof('0' * 64, RUN, wrong, nonce)}")
        raw.wait([f"ticket/{wrong}"], timedelta(seconds=15))
        answer = json.loads(raw.get(f"ticket/{wrong}"))
        assert set(answer) == {"refused"}, answer  # no epoch, no rank: never admitted
        assert not raw.check([f"ticket/{silent}"])
        assert sender.stats()["joins_refused"] == 1 and sender.members == 0

        actors = Actors(1, redis_server.url, RUN, [sender.address], FAST)
        try:
            wait_members(sender, 1, 60)
            state = make_state(1)
            sender.send(1, state)
            (held,) = [actors.get("held", 60)]
            assert held[2] == 1 and held[5] == weights_digest(state)
            assert held[6]["collective"] == 1
            # The group the version went to is the proper actor and the sender: size 2.
            assert sender.members == 1 and sender._group is not None and sender._group.size == 2
            assert sender.stats()["joins_refused"] == 1
        finally:
            actors.close()


def test_a_flood_of_tickets_and_forged_answers_do_not_keep_a_joiner_out(redis_client):
    """Another local process can write the store (it has no authentication): it takes 10^6
    tickets in one call and writes bogus answers for the next tickets before a real actor joins.
    The sender does not count its way through the tickets, and the actor does not act on the
    unsigned answers: it joins the sender's epoch."""
    with sender_at(redis_client) as sender:
        port = int(sender.address.rpartition(":")[2])
        raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        flood = raw.add(JOINS, 10**6)
        bogus = json.dumps({"epoch": 99, "rank": 1, "size": 2})
        for ticket in range(flood + 1, flood + 4):
            raw.set(f"ticket/{ticket}", bogus)
        receiver = CollectiveReceiver(redis_client, RUN, sender.address, join_timeout_s=20.0)
        try:
            started = time.monotonic()
            receiver.join()
            assert time.monotonic() - started < 15
            wait_members(sender, 1, 10)
            assert receiver.group is not None and receiver.group.epoch == sender._epoch != 99
            assert receiver.group.rank == 1
            assert sender.stats()["joins_refused"] == 0
        finally:
            receiver.close()


def test_the_groups_pairs_listen_beside_the_store_not_on_the_hostnames_address(redis_client):
    """The store on 127.0.0.2 (loopback; this machine's hostname resolves elsewhere, to
    127.0.0.1 or a public address): every socket the sender and a member open to listen is on
    127.0.0.2."""
    before = all_listeners()
    with sender_at(redis_client, host="127.0.0.2") as sender:
        receiver = CollectiveReceiver(redis_client, RUN, sender.address, join_timeout_s=20.0)
        try:
            receiver.join()
            wait_members(sender, 1, 10)
            opened = all_listeners() - before
            assert len(opened) >= 3, opened  # the store, and gloo on each side
            assert {ip for ip, _ in opened} == {"127.0.0.2"}, opened
        finally:
            receiver.close()


def test_a_member_falls_back_to_redis_when_the_sender_fails_a_version(redis_client, tmp_path):
    writer = WeightWriter(redis_client, RUN, retention=4)
    fallback_s = 2.0
    with sender_at(redis_client, FailingSender) as sender:
        feed = CollectiveFeed(
            WeightReader(redis_client, RUN),
            sender.address,
            join_timeout_s=5.0,
            rejoin_s=0.5,
            timeout_s=10.0,
            poll_interval_s=0.2,
            fallback_s=fallback_s,
        )
        with feed:
            wait_members(sender, 1, 30)
            writer.publish(1, make_state(1))
            sender.send(1, make_state(1))
            got = feed.wait(30)
            assert got is not None and got[0] == 1
            assert feed.group_stats()["collective"] == 1 and feed.group_stats()["redis"] == 0

            published = time.monotonic()
            writer.publish(2, make_state(2))
            sender.send(2, make_state(2))  # fails on the sender's thread; heartbeats go on
            got = feed.wait(fallback_s + 20)
            waited = time.monotonic() - published
            assert got is not None and got[0] == 2
            assert weights_digest(got[1]) == weights_digest(make_state(2))
            assert fallback_s * 0.9 <= waited < fallback_s + 20  # not before the bound
            assert feed.member  # still a member: it fell back, it did not leave
            counts = feed.group_stats()
            assert (counts["collective"], counts["redis"], counts["fallbacks"]) == (1, 1, 1)
            assert feed.stats()[mn.ACTOR_WEIGHT_GROUP_FALLBACKS] == 1

            # The sender's error is in the learner's metrics, and on its /metrics.
            metrics = sender.metrics()
            assert metrics[mn.LEARNER_WEIGHTS_GROUP_ERRORS] == 1
            assert metrics[mn.LEARNER_WEIGHTS_GROUP_ERROR_VERSION] == 2
            assert metrics[mn.LEARNER_WEIGHTS_GROUP_VERSIONS_SENT] == 1
            assert metrics[mn.LEARNER_WEIGHTS_GROUP_MEMBERS] == 1
            exporter = LearnerExporter(0, "127.0.0.1", tmp_path)
            try:
                exporter.watch(sender.metrics)
                assert exporter.port is not None
                scraped = scrape(exporter.port)
            finally:
                exporter.close()
            assert scraped[("specrl_learner_weights_group_errors_total", ())] == 1
            assert scraped[("specrl_learner_weights_group_error_version", ())] == 2
            assert scraped[("specrl_learner_weights_group_members", ())] == 1

            # The group serves the next version again.
            writer.publish(3, make_state(3))
            sender.send(3, make_state(3))
            got = feed.wait(30)
            assert got is not None and got[0] == 3
            assert feed.group_stats()["collective"] == 2


def test_a_sender_on_cuda_is_refused_before_it_listens(redis_client):
    port = find_free_port()
    with pytest.raises(CollectiveError, match="not been run on a GPU"):
        CollectiveSender(redis_client, RUN, f"127.0.0.1:{port}", device="cuda")
    assert listeners(port) == set()

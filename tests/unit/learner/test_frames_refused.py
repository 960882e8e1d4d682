"""Every frame the learner does not train on is counted on its /metrics: hostile frames over real
ZeroMQ sockets into a real receiver, read by the learner's real exporter over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from common import metric_names as mn
from common.link.protocol import encode
from common.link.receive.admission import Admission, wire_limits
from common.link.receive.receiver import GroupReceiver
from common.link.transport import connect_dealer
from learner.buffer import StalenessBuffer
from learner.exporter import LearnerExporter
from testing.hostile import MiB, oversized_frames, replies, send_when_connected, valid_group
from testing.prometheus import scrape
from testing.transport import ANY_PORT, VOCAB, retry_bind, wait_until

ADMISSION = Admission(group_size=4, max_seq_tokens=64, max_abs_reward=1e6)
ACTOR = "hostile"


def started(socket_bytes: int, tmp_path: Path) -> tuple[GroupReceiver, LearnerExporter]:
    """A receiver with the learner's wire limits for a socket bound of ``socket_bytes``, and
    the learner's exporter serving its counters live (as the learner wires them)."""
    limits, _ = wire_limits(VOCAB, ADMISSION, socket_bytes)
    receiver = GroupReceiver(ANY_PORT, limits, admission=ADMISSION, latest_version=lambda: 0)
    retry_bind(receiver.start)
    exporter = LearnerExporter(0, "127.0.0.1", tmp_path)
    exporter.watch(receiver.intake.stats)
    return receiver, exporter


@pytest.fixture
def dealer_factory() -> Iterator:
    dealers: list[zmq.Socket] = []

    def make(address: str) -> zmq.Socket:
        dealers.append(connect_dealer(address, ACTOR.encode()))
        return dealers[-1]

    yield make
    for dealer in dealers:
        dealer.close(linger=0)


def counter(metrics: dict, family: str, reason: str | None = None) -> float:
    labels = (("reason", reason),) if reason is not None else ()
    return metrics.get((f"specrl_learner_{family}_total", labels), 0.0)


def test_frames_over_the_decode_bound_are_read_counted_and_the_link_stays_up(
    tmp_path, dealer_factory
) -> None:
    """Each hostile frame that libzmq used to drop with the connection (100,000 deep, 200,000
    map keys, a 1 MB actor id, 1,025 completions, 16 and 63 MiB bombs) is read, counted as
    ``oversize`` on /metrics, trains nothing, and the same connection then delivers a group."""
    receiver, exporter = started(64 * MiB, tmp_path)
    try:
        frame_bound = receiver._limits.max_frame_bytes
        assert frame_bound < 100_000 <= min(len(p.frame) for p in oversized_frames(ACTOR))
        dealer = dealer_factory(receiver.bound_address)
        for n, poison in enumerate(oversized_frames(ACTOR), start=1):
            send_when_connected(dealer, [poison.frame])
            wait_until(lambda n=n: receiver.intake.bad_frames_by_reason()["oversize"] == n, 30)
            metrics = scrape(exporter.port)
            assert counter(metrics, "bad_frames", "oversize") == n, poison.kind
            assert counter(metrics, "frames_refused", "oversize") == n, poison.kind
        assert receiver.intake.received == 0 and receiver.intake.qsize() == 0
        # Read, not dropped: the connection never closed, and a valid group still comes through.
        assert receiver.intake.disconnects == 0
        send_when_connected(dealer, [encode(valid_group(ACTOR, 7, ADMISSION.group_size))])
        acks = replies(dealer, lambda acks: any(a.seqs for a in acks), timeout_s=10)
        assert [s for a in acks for s in a.seqs] == [7]
        assert receiver.intake.get(timeout_s=5).seq == 7
        assert counter(scrape(exporter.port), "groups_received") == 1
    finally:
        exporter.close()
        receiver.close()


def test_a_frame_over_the_socket_bound_ends_its_connection_and_is_counted(
    tmp_path, dealer_factory
) -> None:
    """libzmq refuses a frame over ``learner.max_frame_bytes`` unread, closing its connection;
    the closed connection is on /metrics, and the actor reconnects and is served."""
    receiver, exporter = started(1 * MiB, tmp_path)
    try:
        assert receiver._limits.socket_bytes == 1 * MiB
        dealer = dealer_factory(receiver.bound_address)
        send_when_connected(dealer, [encode(valid_group(ACTOR, 0, ADMISSION.group_size))])
        assert receiver.intake.get(timeout_s=5).seq == 0
        assert receiver.intake.disconnects == 0
        send_when_connected(dealer, [bytes(2 * MiB)])
        wait_until(lambda: receiver.intake.disconnects >= 1, 10)
        assert counter(scrape(exporter.port), "connections_closed") >= 1
        assert sum(receiver.intake.bad_frames_by_reason().values()) == 0  # never read
        # The DEALER reconnects by itself; the next group is served on the new connection.
        send_when_connected(dealer, [encode(valid_group(ACTOR, 1, ADMISSION.group_size))])
        assert receiver.intake.get(timeout_s=10).seq == 1
    finally:
        exporter.close()
        receiver.close()


def test_refused_stale_and_duplicate_groups_show_in_the_refusal_counters(
    tmp_path, dealer_factory
) -> None:
    """A group refused by admission, a resent duplicate and a group the buffer drops as too
    stale are each on /metrics under their reason, alongside a bad frame; the counters never go
    back when a step's older record arrives after a live scrape."""
    receiver, exporter = started(64 * MiB, tmp_path)
    try:
        dealer = dealer_factory(receiver.bound_address)
        too_small = valid_group(ACTOR, 0, ADMISSION.group_size - 1)
        old = valid_group(ACTOR, 1, ADMISSION.group_size)
        for frame in (encode(too_small), encode(old), encode(old), b"\xc1"):
            send_when_connected(dealer, [frame])
        wait_until(lambda: receiver.intake.bad_frames == 1 and receiver.intake.duplicates == 1, 10)
        buffer = StalenessBuffer(max_staleness=2, admission=ADMISSION)
        # At learner version 3 the version-0 group is 3 versions old: dropped as stale.
        assert not buffer.admit(receiver.intake.get(timeout_s=5), learner_version=3)
        assert buffer.dropped_stale == 1
        record = {**receiver.intake.stats(), mn.LEARNER_DROPPED_STALE: buffer.dropped_stale}
        exporter.update(record, np.array([], dtype=np.int64))
        metrics = scrape(exporter.port)
        assert counter(metrics, "groups_refused", "wrong_group_size") == 1
        assert counter(metrics, "groups_dropped_stale") == 1
        shown = {
            reason: counter(metrics, "frames_refused", reason)
            for reason in ("wrong_group_size", "stale", "duplicate", "not_msgpack")
        }
        assert shown == dict.fromkeys(shown, 1.0)
        # A step record older than the live receiver (no duplicates yet) lowers nothing.
        exporter.update({mn.RECEIVER_DUPLICATES: 0, mn.LEARNER_DROPPED_STALE: 1}, [])
        metrics = scrape(exporter.port)
        assert counter(metrics, "frames_refused", "duplicate") == 1
        assert counter(metrics, "groups_duplicated") == 1
    finally:
        exporter.close()
        receiver.close()

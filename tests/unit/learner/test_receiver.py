"""GroupSender <-> GroupReceiver over real ZeroMQ tcp on 127.0.0.1 (random free ports)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from common.link.protocol import (
    Ack,
    Heartbeat,
    decode,
    encode,
)
from common.link.receive.intake import DedupeWindow
from common.link.receive.receiver import GroupReceiver, bind_router, bound_endpoint
from common.link.send.sender import GroupSender
from common.link.transport import connect_dealer
from testing.transport import (
    ANY_PORT,
    LIMITS,
    VOCAB,
    drain,
    make_group,
    start_receiver,
    wait_until,
)


@pytest.fixture
def receiver() -> Iterator[GroupReceiver]:
    r = start_receiver()
    yield r
    r.close()


def test_two_senders_every_group_exactly_once(receiver: GroupReceiver) -> None:
    n = 60

    def produce(sender: GroupSender, offset: int) -> None:
        for i in range(n):
            sender.submit(make_group(offset + i), timeout_s=10.0)

    with (
        GroupSender(receiver.bound_address, "actor-a", outbox_max=8) as a,
        GroupSender(receiver.bound_address, "actor-b", outbox_max=8) as b,
    ):
        threads = [
            threading.Thread(target=produce, args=(s, k * 1000)) for k, s in ((0, a), (1, b))
        ]
        for t in threads:
            t.start()
        groups = drain(receiver, 2 * n)
        for t in threads:
            t.join()
        assert a.flush(5.0) and b.flush(5.0)
        assert a.acked_total == n and b.acked_total == n
    keys = {(g.actor_id, g.seq) for g in groups}
    assert keys == {(actor, s) for actor in ("actor-a", "actor-b") for s in range(n)}
    assert {g.prompt_id for g in groups} == {
        f"prompt-{k * 1000 + i}" for k in (0, 1) for i in range(n)
    }
    assert receiver.intake.get(timeout_s=0.05) is None
    assert receiver.intake.received == 2 * n
    assert receiver.intake.acks_sent == 2 * n + receiver.intake.duplicates
    assert receiver.intake.bad_frames == 0
    stats = receiver.intake.stats()
    assert stats["receiver/received"] == 2 * n and stats["receiver/bad_frames/oversize"] == 0


def test_resent_duplicates_are_acked_but_not_queued(receiver: GroupReceiver) -> None:
    # Acks take no time here, so a tiny resend timeout mostly produces resends of groups that
    # were already received: the duplicates path under load.
    with GroupSender(receiver.bound_address, "actor-a", resend_timeout_s=0.001) as sender:
        for i in range(20):
            sender.submit(make_group(i))
        groups = drain(receiver, 20)
        assert sender.flush(5.0)
    assert sorted(g.seq for g in groups) == list(range(20))
    assert receiver.intake.get(timeout_s=0.1) is None
    assert receiver.intake.received == 20


def test_duplicate_from_raw_dealer_is_reacked(receiver: GroupReceiver) -> None:
    dealer = connect_dealer(receiver.bound_address, b"raw-1")
    try:
        frame = encode(make_group(1, actor_id="raw-1", seq=0))
        for _ in range(3):
            dealer.send(frame)
        # Acks are batched (one per actor per batch, each seq once), so 1 to 3 acks come back.
        assert dealer.poll(5000)
        acks = [decode(dealer.recv(), LIMITS)]
        while dealer.poll(300):
            acks.append(decode(dealer.recv(), LIMITS))
        assert 1 <= len(acks) <= 3 and all(a == Ack(actor_id="raw-1", seqs=[0]) for a in acks)
        assert [g.seq for g in drain(receiver, 1)] == [0]
        assert receiver.intake.get(timeout_s=0.05) is None
        assert receiver.intake.duplicates == 2 and receiver.intake.received == 1
        assert receiver.intake.acks_sent == len(acks)
    finally:
        dealer.close(linger=0)


def test_receiver_restart_mid_stream_loses_nothing() -> None:
    n = 40
    # queue_max=4 makes the first receiver stop reading, so when it closes, 8 sent-but-unread
    # groups die in its socket buffers: exactly the in-flight loss a restart causes.
    first = start_receiver(queue_max=4)
    address = first.bound_address
    # A resend timeout far beyond the test's deadlines: only the reconnect path can recover.
    sender = GroupSender(address, "actor-a", outbox_max=8, resend_timeout_s=60.0).start()
    producer = threading.Thread(
        target=lambda: [sender.submit(make_group(i), timeout_s=20.0) for i in range(n)]
    )
    producer.start()
    try:
        wait_until(lambda: first.intake.qsize() == 4 and sender.unacked() == 8)
        wait_until(lambda: sender.stats()["sender/unsent"] == 0)
        first.close()
        seen = drain(first, 4, timeout_s=0.1)  # acked before close: still the learner's
        state = json.loads(
            json.dumps(first.intake.dedupe_state())
        )  # as a checkpoint would store it

        second = GroupReceiver(address, LIMITS)
        second.intake.load_dedupe_state(state)
        deadline = time.monotonic() + 5.0
        while True:
            try:
                second.start()
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        try:
            seen += drain(second, n - len(seen))
            producer.join(timeout=10.0)
            assert sender.flush(5.0)
            assert second.intake.get(timeout_s=0.05) is None
            assert second.intake.duplicates == 0
        finally:
            second.close()
        assert sender.resent_total >= 8
        assert sender.stats()["sender/reconnects"] >= 1
    finally:
        sender.close(timeout_s=0.0)
        producer.join(timeout=5.0)
    assert sorted(g.seq for g in seen) == list(range(n))


BAD_FRAMES = [
    (b"\xc1not msgpack", "not_msgpack"),
    (msgpack.packb([1, 2, 3]), "not_map"),
    (msgpack.packb({"v": 99, "type": "group"}), "wrong_version"),
    (msgpack.packb({"v": 1, "type": "nope"}), "wrong_type"),
    (encode(make_group(1, actor_id="raw-1"))[:-3], "not_msgpack"),
    (encode(make_group(1, actor_id="someone-else")), "identity_mismatch"),
    (encode(Ack(actor_id="raw-1", seqs=[1])), "wrong_direction"),
]


def test_bad_frames_are_counted_and_receiver_keeps_serving(
    receiver: GroupReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    dealer = connect_dealer(receiver.bound_address, b"raw-1")
    try:
        for frame, _ in BAD_FRAMES:
            dealer.send(frame)
        dealer.send_multipart([b"two", b"frames"])
        token_out_of_vocab = make_group(1, actor_id="raw-1")
        token_out_of_vocab.completions[0].token_ids[0] = VOCAB
        dealer.send(encode(token_out_of_vocab))
        expected = len(BAD_FRAMES) + 2
        wait_until(lambda: receiver.intake.bad_frames == expected)
        by_reason = receiver.intake.bad_frames_by_reason()
        for _, reason in BAD_FRAMES:
            assert by_reason[reason] >= 1, reason
        assert by_reason["bad_envelope"] == 1 and by_reason["out_of_vocab"] == 1
        assert receiver.intake.stats()["receiver/bad_frames"] == expected
        assert "bad frame from 'raw-1': not_msgpack" in caplog.text  # logged with the peer
        assert not dealer.poll(50)  # rejected frames are never acked
        assert receiver.intake.live_actors() == {}  # nor do they count as signs of life
        # The same connection, and a proper sender, are still served.
        dealer.send(encode(make_group(2, actor_id="raw-1", seq=0)))
        assert dealer.poll(5000)
        assert decode(dealer.recv(), LIMITS) == Ack(actor_id="raw-1", seqs=[0])
        with GroupSender(receiver.bound_address, "actor-a") as sender:
            sender.submit(make_group(3))
            assert sender.flush(5.0)
        assert {(g.actor_id, g.seq) for g in drain(receiver, 2)} == {("raw-1", 0), ("actor-a", 0)}
    finally:
        dealer.close(linger=0)


def test_backpressure_blocks_submit_instead_of_growing_memory() -> None:
    receiver = start_receiver(queue_max=3)
    try:
        with GroupSender(
            receiver.bound_address, "actor-a", outbox_max=3, resend_timeout_s=60.0
        ) as sender:
            for i in range(6):  # 3 fill the receiver's queue, 3 wait unacked in the outbox
                sender.submit(make_group(i), timeout_s=5.0)
            wait_until(lambda: receiver.intake.qsize() == 3)
            with pytest.raises(TimeoutError):
                sender.submit(make_group(6), timeout_s=0.2)
            assert receiver.intake.qsize() == 3 and receiver.intake.received == 3
            assert sender.unacked() == 3
            # Consuming frees the queue, reading resumes, acks flow, the actor unblocks.
            got = drain(receiver, 3)
            sender.submit(make_group(6), timeout_s=5.0)
            got += drain(receiver, 4)
            assert sender.flush(5.0)
        assert sorted(g.seq for g in got) == list(range(7))
    finally:
        receiver.close()


def test_live_actors_follow_heartbeats_and_forget_silent_ones() -> None:
    receiver = start_receiver(actor_timeout_s=0.3)
    try:
        sender = GroupSender(receiver.bound_address, "actor-a", heartbeat_interval_s=0.05)
        sender.set_status(7, {"actor/tokens_per_s": 321.0})
        sender.start()
        wait_until(lambda: "actor-a" in receiver.intake.live_actors())
        wait_until(lambda: receiver.intake.live_actors()["actor-a"].version == 7)
        info = receiver.intake.live_actors()["actor-a"]
        assert info.stats == {"actor/tokens_per_s": 321.0} and info.heartbeats >= 1
        time.sleep(0.4)  # longer than actor_timeout_s: heartbeats keep it alive
        assert "actor-a" in receiver.intake.live_actors()
        sender.close(timeout_s=0.0)
        wait_until(lambda: receiver.intake.live_actors() == {}, timeout_s=3.0)
        assert receiver.intake.stats()["receiver/live_actors"] == 0
    finally:
        receiver.close()


def test_an_actor_is_not_forgotten_while_the_learner_is_not_reading() -> None:
    # A full queue stops the I/O thread reading (backpressure), heartbeats included: a learner
    # step longer than actor_timeout_s must not make every actor look silent. Its own silence
    # still counts once reading resumes.
    receiver = start_receiver(actor_timeout_s=0.3, queue_max=1)
    try:
        sender = GroupSender(receiver.bound_address, "actor-a", heartbeat_interval_s=0.05)
        sender.set_status(3, {"actor/tokens_per_s": 5.0})
        sender.start()
        sender.submit(make_group(0), timeout_s=5.0)
        sender.submit(make_group(1), timeout_s=5.0)  # waits unread: the queue holds one
        wait_until(lambda: receiver.intake.qsize() == 1)
        time.sleep(0.8)  # well past actor_timeout_s, reading nothing
        assert "actor-a" in receiver.intake.live_actors()
        assert receiver.intake.stats()["receiver/live_actors"] == 1
        assert [g.seq for g in drain(receiver, 2)] == [0, 1]
        sender.close(timeout_s=1.0)
        wait_until(lambda: receiver.intake.live_actors() == {}, timeout_s=3.0)
    finally:
        receiver.close()


def test_dedupe_window_compacts() -> None:
    window = DedupeWindow()
    assert [window.add(s) for s in (0, 2, 3, 2, 0, 1, 5)] == [
        True,
        True,
        True,
        False,
        False,
        True,
        True,
    ]
    assert window.floor == 3 and window.above == {5}


def test_dedupe_state_round_trip_and_validation() -> None:
    first = GroupReceiver(ANY_PORT, LIMITS)
    state = {"format": 1, "actors": {"a": {"floor": 4, "above": [6, 9]}}}
    first.intake.load_dedupe_state(state)
    assert first.intake.dedupe_state() == state
    assert msgpack.unpackb(msgpack.packb(state)) == state
    first.intake.load_dedupe_state({})
    assert first.intake.dedupe_state() == {"format": 1, "actors": {}}
    for bad in (
        {"format": 2, "actors": {}},
        {"format": 1, "actors": {"a": {"floor": "4", "above": []}}},
        {"format": 1, "actors": {"a": {"floor": 4, "above": [3]}}},
        {"format": 1, "actors": {"a": [4]}},
    ):
        with pytest.raises(ValueError):
            first.intake.load_dedupe_state(bad)


def test_loaded_dedupe_state_drops_replays(receiver: GroupReceiver) -> None:
    fresh = GroupReceiver(ANY_PORT, LIMITS)
    fresh.intake.load_dedupe_state({"format": 1, "actors": {"raw-1": {"floor": 1, "above": [3]}}})
    fresh.start()
    try:
        with pytest.raises(RuntimeError, match="before start"):
            fresh.intake.load_dedupe_state({})
        dealer = connect_dealer(fresh.bound_address, b"raw-1")
        try:
            for seq in range(5):
                dealer.send(encode(make_group(seq, actor_id="raw-1", seq=seq)))
            assert sorted(g.seq for g in drain(fresh, 2)) == [2, 4]
            wait_until(lambda: fresh.intake.acks_sent == 5)
            assert fresh.intake.duplicates == 3
            assert fresh.intake.dedupe_state()["actors"]["raw-1"] == {"floor": 4, "above": []}
        finally:
            dealer.close(linger=0)
    finally:
        fresh.close()


class _LogThatFailsToFlush:
    """A write-ahead log whose flush fails (a disk gone): the I/O thread must fail with it."""

    def __init__(self) -> None:
        self.appended = 0
        self.closed = False

    def append(self, frame: bytes) -> None:
        self.appended += 1

    def flush(self) -> None:
        raise OSError("disk gone")

    def cut(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


def test_io_thread_failure_reaches_get_and_closes_the_log() -> None:
    wal = _LogThatFailsToFlush()
    receiver = start_receiver(wal=wal)
    dealer = connect_dealer(receiver.bound_address, b"raw-1")
    try:
        with pytest.raises(RuntimeError, match="mark_seen must be called before start"):
            receiver.intake.mark_seen([])
        dealer.send(encode(make_group(0, actor_id="raw-1", seq=0)))
        taken = []  # queued before the flush failed: get may take it before the failure shows
        with pytest.raises(RuntimeError, match="receiver I/O thread failed") as failed:
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                taken.append(receiver.intake.get(timeout_s=0.1))
        assert isinstance(failed.value.__cause__, OSError)
        wait_until(lambda: wal.closed)
        assert not dealer.poll(100)  # nothing unlogged was acked
        # Whatever get did not take, shutdown still can (drain does not raise).
        taken += receiver.intake.drain()
        assert [g.seq for g in taken if g is not None] == [0] and wal.appended == 1
    finally:
        dealer.close(linger=0)
        receiver.close()


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_keys_encrypt_the_link() -> None:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    router = bind_router(ANY_PORT, curve_secret_key=server_secret, curve_public_key=server_public)
    dealer = connect_dealer(
        bound_endpoint(router),
        b"actor-a",
        curve_secret_key=client_secret,
        curve_public_key=client_public,
        curve_server_key=server_public,
    )
    try:
        frame = encode(Heartbeat(actor_id="actor-a", version=1, stats={}, sent_at=1.0))
        deadline = time.monotonic() + 5.0
        while True:  # IMMEDIATE: sends are refused until the CURVE handshake is done
            try:
                dealer.send(frame, zmq.NOBLOCK)
                break
            except zmq.Again:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        assert router.poll(5000)
        assert router.recv_multipart() == [b"actor-a", frame]
    finally:
        dealer.close(linger=0)
        router.close(linger=0)


def test_frames_left_on_a_handed_over_connection_are_dropped_not_counted_bad() -> None:
    """A reconnecting actor takes its identity over (ROUTER_HANDOVER); frames still buffered on
    its old connection arrive under a NUL-led id: dropped apart, the actor resends them."""
    receiver = start_receiver(queue_max=1)
    old = connect_dealer(receiver.bound_address, b"actor-x")
    new = None
    try:
        old.send(encode(make_group(0, actor_id="actor-x", seq=0)))
        wait_until(lambda: receiver.intake.qsize() == 1)  # full: the receiver stops reading
        for seq in (1, 2):
            old.send(encode(make_group(seq, actor_id="actor-x", seq=seq)))
        new = connect_dealer(receiver.bound_address, b"actor-x")
        time.sleep(0.5)
        new.send(encode(make_group(3, actor_id="actor-x", seq=3)), zmq.NOBLOCK)
        got = drain(receiver, 1)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            group = receiver.intake.get(timeout_s=0.05)
            if group is not None:
                got.append(group)
        seqs = sorted(g.seq for g in got)
        stats = receiver.intake.stats()
        assert stats["receiver/bad_frames"] == 0
        assert seqs[0] == 0 and 3 in seqs
        # Frames 1 and 2 are accepted, discarded with the old pipe by libzmq, or dropped as
        # handover leftovers (which of the three depends on timing), but never counted bad;
        # the actor's resend delivers them.
        assert len(seqs) + stats["receiver/handover_dropped"] <= 4
    finally:
        old.close(linger=0)
        if new is not None:
            new.close(linger=0)
        receiver.close()

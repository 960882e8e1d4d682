"""GroupSender against a hand-driven ROUTER on 127.0.0.1: seqs, acks, resends, backpressure."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from common.link.protocol import Ack, DecodeLimits, ProtocolError, TrajectoryGroup, encode
from common.link.send.sender import GroupSender, unique_actor_id
from testing.transport import FakeLearner, one_completion_group, retry_bind, wait_until

LIMITS = DecodeLimits(vocab_size=50)


def make_group(token: int = 1) -> TrajectoryGroup:
    return one_completion_group(
        [token], [-0.1], prompt_id=f"p{token}", prompt_ids=[1, 2], reward=0.0
    )


@pytest.fixture
def learner() -> Iterator[FakeLearner]:
    fake = FakeLearner(LIMITS)
    yield fake
    fake.close()


def test_seqs_identity_and_acks(learner: FakeLearner) -> None:
    with GroupSender(learner.address, "actor-a", resend_timeout_s=30.0) as sender:
        groups = [make_group(i) for i in range(3)]
        assert [sender.submit(g) for g in groups] == [0, 1, 2]
        assert [g.seq for g in groups] == [0, 1, 2] and groups[0].actor_id == "actor-a"
        learner.pump_until(lambda: len(learner.groups) == 3)
        assert {ident for ident, _ in learner.groups} == {b"actor-a"}
        assert learner.seqs() == [0, 1, 2]
        assert sender.unacked() == 3
        learner.ack("actor-a", [0, 2])
        wait_until(lambda: sender.unacked() == 1)
        learner.ack("actor-a", [1, 1, 0])  # repeated and stale seqs are harmless
        assert sender.flush(5.0)
        assert sender.acked_total == 3
        assert sender.resent_total == 0


def test_resends_after_timeout_until_acked(learner: FakeLearner) -> None:
    with GroupSender(learner.address, "actor-a", resend_timeout_s=0.2) as sender:
        sender.submit(make_group())
        learner.pump_until(lambda: len(learner.groups) >= 3)
        assert set(learner.seqs()) == {0}
        wait_until(lambda: sender.resent_total >= 2)
        learner.ack("actor-a", [0])
        assert sender.flush(5.0)


def test_groups_submitted_before_learner_exists_are_delivered() -> None:
    probe = FakeLearner(LIMITS)
    address = probe.address
    probe.close()  # a port nobody listens on (for now)
    with GroupSender(address, "actor-a", resend_timeout_s=30.0) as sender:
        sender.submit(make_group(1))
        sender.submit(make_group(2))
        time.sleep(0.1)
        learner = _rebind(address)
        try:
            learner.pump_until(lambda: len(learner.groups) >= 2)
            assert sorted(set(learner.seqs())) == [0, 1]
            learner.ack("actor-a", [0, 1])
            assert sender.flush(5.0)
        finally:
            learner.close()


def test_full_outbox_blocks_then_times_out(learner: FakeLearner) -> None:
    with GroupSender(learner.address, "actor-a", outbox_max=2, resend_timeout_s=30.0) as sender:
        sender.submit(make_group())
        sender.submit(make_group())
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            sender.submit(make_group(), timeout_s=0.2)
        assert time.monotonic() - start >= 0.19
        learner.pump_until(lambda: len(learner.groups) == 2)
        learner.ack("actor-a", [0])
        # Space freed by the ack unblocks a waiting submit; the timed-out one used no seq.
        assert sender.submit(make_group(), timeout_s=5.0) == 2
        learner.ack("actor-a", [1, 2])
        assert sender.flush(5.0)


def test_heartbeats_carry_status(learner: FakeLearner) -> None:
    with GroupSender(learner.address, "actor-a", heartbeat_interval_s=0.05) as sender:
        sender.set_status(9, {"actor/tokens_per_s": 12.5})
        learner.pump_until(
            lambda: any(h.version == 9 for h in learner.heartbeats) and len(learner.heartbeats) >= 3
        )
        beat = next(h for h in learner.heartbeats if h.version == 9)
        assert beat.actor_id == "actor-a" and beat.stats == {"actor/tokens_per_s": 12.5}
        assert abs(beat.sent_at - time.time()) < 60


def test_malformed_group_is_refused_without_using_a_seq(learner: FakeLearner) -> None:
    with GroupSender(learner.address, "actor-a", limits=LIMITS) as sender:
        bad = make_group()
        bad.completions[0].reward = float("nan")
        with pytest.raises(ProtocolError, match="non_finite"):
            sender.submit(bad)
        out_of_vocab = make_group(token=LIMITS.vocab_size)
        with pytest.raises(ProtocolError, match="out_of_vocab"):
            sender.submit(out_of_vocab)
        with pytest.raises(ValueError, match="actor_id"):
            sender.submit(TrajectoryGroup(**{**make_group().__dict__, "actor_id": "other"}))
        with pytest.raises(ProtocolError):
            sender.set_status(-1, {})
        assert sender.submit(make_group()) == 0
        assert sender.unacked() == 1
        learner.pump_until(lambda: len(learner.groups) == 1)
        learner.ack("actor-a", [0])
        assert sender.flush(5.0)


def test_oversize_group_is_refused(learner: FakeLearner) -> None:
    small = DecodeLimits(vocab_size=50, max_frame_bytes=512)
    with GroupSender(learner.address, "actor-a", limits=small) as sender:
        huge = make_group()
        huge.prompt_ids = np.ones(200, dtype=np.int32)
        with pytest.raises(ProtocolError, match="oversize"):
            sender.submit(huge)
        assert sender.unacked() == 0


def test_bad_replies_are_counted_and_ignored(learner: FakeLearner) -> None:
    with GroupSender(learner.address, "actor-a", resend_timeout_s=30.0) as sender:
        sender.submit(make_group())
        learner.pump_until(lambda: len(learner.groups) == 1)
        learner.sock.send_multipart([b"actor-a", b"\xc1garbage"])
        learner.sock.send_multipart([b"actor-a", encode(Ack(actor_id="someone-else", seqs=[0]))])
        wait_until(lambda: sender.stats()["sender/bad_replies"] == 2)
        assert sender.unacked() == 1
        learner.ack("actor-a", [0])
        assert sender.flush(5.0)


def test_close_reports_unacked_and_refuses_more(
    learner: FakeLearner, caplog: pytest.LogCaptureFixture
) -> None:
    sender = GroupSender(learner.address, "actor-a").start()
    sender.submit(make_group())
    sender.close(timeout_s=0.1)
    assert "1 unacked" in caplog.text
    with pytest.raises(RuntimeError, match="closed"):
        sender.submit(make_group())


def test_unique_actor_id() -> None:
    a, b = unique_actor_id("actor-3"), unique_actor_id("actor-3")
    assert a != b and a.startswith("actor-3-")


def _rebind(address: str, timeout_s: float = 5.0) -> FakeLearner:
    return retry_bind(lambda: FakeLearner(LIMITS, address), timeout_s)

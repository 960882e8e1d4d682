"""Admission (common/link/receive/admission.py): what a decoded group must also be to be trained on, and the
decode limits derived from it; the sender's side of a refusal over real sockets."""

from __future__ import annotations

import time
import tracemalloc

import msgpack
import numpy as np
import pytest

from common.link.protocol import DecodeLimits, ProtocolError, decode, encode
from common.link.receive.admission import Admission, wire_limits
from common.link.send.sender import GroupSender
from testing.hostile import poisoned_frames, valid_group
from testing.transport import drain, start_receiver

ADMISSION = Admission(group_size=4, max_seq_tokens=64, max_abs_reward=100.0)


def test_a_valid_group_is_admitted_and_each_poison_gets_its_verdict() -> None:
    limits, _ = wire_limits(50, ADMISSION, 64 << 20)
    assert ADMISSION.refusal(valid_group("a", 0, 4), latest_version=0) is None
    for poison in poisoned_frames("a", 4, 64, latest_version=3):
        try:
            refusal = ADMISSION.refusal(decode(poison.frame, limits), latest_version=3)
            verdict = ("refused", refusal.reason) if refusal else ("admitted", "")
        except ProtocolError as e:
            verdict = ("bad", e.reason)
        assert verdict == (poison.verdict, poison.reason), poison.kind


@pytest.mark.parametrize(
    ("reward", "admitted"),
    [(100.0, True), (-100.0, True), (100.5, False), (3.5e38, False), (float("1e300"), False)],
)
def test_reward_bound_is_checked_in_float32(reward: float, admitted: bool) -> None:
    group = valid_group("a", 0, 4, reward=reward)
    bound = Admission(4, 64, max_abs_reward=100.0)
    assert (bound.refusal(group, 0) is None) is admitted
    # A bound above float32's range still refuses what float32 cannot hold.
    assert (Admission(4, 64, 1e300).refusal(group, 0) is None) is (abs(reward) < 3.4e38)


def test_version_ahead_of_the_learner_is_refused_behind_is_not() -> None:
    assert ADMISSION.refusal(valid_group("a", 0, 4, version=5), latest_version=5) is None
    assert ADMISSION.refusal(valid_group("a", 0, 4, version=2), latest_version=5) is None
    assert ADMISSION.refusal(valid_group("a", 0, 4, version=6), 5).reason == "version_ahead"


def test_length_is_prompt_plus_longest_completion() -> None:
    fits = valid_group("a", 0, 4, prompt_len=32, completion_len=32)
    over = valid_group("a", 0, 4, prompt_len=32, completion_len=33)
    assert ADMISSION.refusal(fits, 0) is None
    assert ADMISSION.refusal(over, 0).reason == "too_long"


def test_wire_limits_bound_frames_to_what_a_valid_group_can_be() -> None:
    limits, socket_bytes = wire_limits(50, ADMISSION, 64 << 20)
    frame_bytes = limits.max_frame_bytes
    assert frame_bytes < 1 << 20
    # The socket still reads frames up to the configured bound, to refuse and count them.
    assert limits.socket_bytes == socket_bytes == 64 << 20
    # The largest admissible group fits, with its stats map full.
    biggest = valid_group("a", 0, 4, prompt_len=32, completion_len=32)
    biggest.stats = {f"{'s' * 200}{i:03d}": 1.0 for i in range(limits.max_stats_entries)}
    assert len(encode(biggest, limits)) <= frame_bytes
    # The configured bound wins when it is smaller, for decoding and the socket alike.
    limits, socket_bytes = wire_limits(50, ADMISSION, 8192)
    assert limits.max_frame_bytes == socket_bytes == 8192


def test_decoding_many_tiny_objects_stops_early_with_bounded_memory() -> None:
    """A 48 MiB frame of nested short strings (under the default 64 MiB frame bound) used to
    take 2.2 s and 1 GB to reject; the object budget stops it after a valid frame's worth."""
    rows = 48 * 1024 * 1024 // (4096 * 3)
    frame = msgpack.packb({"v": 1, "type": "group", "completions": [["ab"] * 4096] * rows})
    assert len(frame) > 40 * 1024 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as info:
            decode(frame, DecodeLimits(vocab_size=50))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.reason == "oversize"
    assert peak < 16 * 1024 * 1024, f"decoding allocated {peak / 2**20:.0f} MiB"


def test_sender_drops_and_counts_refused_groups_and_keeps_delivering() -> None:
    version = 0
    receiver = start_receiver(admission=ADMISSION, latest_version=lambda: version)
    try:
        with GroupSender(receiver.bound_address, "actor-a", resend_timeout_s=0.5) as sender:
            refused = sender.submit(valid_group("", 0, 3))  # wrong group size
            ahead = sender.submit(valid_group("", 0, 4, version=9))
            good = sender.submit(valid_group("", 0, 4))
            assert sender.flush(timeout_s=10), "refused groups must leave the outbox"
            [got] = drain(receiver, 1)
            assert got.seq == good
            stats = sender.stats()
            assert stats["sender/acked_total"] == 1
            assert stats["sender/refused/wrong_group_size"] == 1
            assert stats["sender/refused/version_ahead"] == 1
            time.sleep(1.5)  # past the resend timeout: nothing refused is sent again
            assert receiver.intake.refused_by_reason() == {
                "wrong_group_size": 1,
                "too_long": 0,
                "reward_out_of_range": 0,
                "version_ahead": 1,
            }
            taken = receiver.intake.take_refused()
            assert sorted((seq, reason) for _, seq, _, reason in taken) == [
                (refused, "wrong_group_size"),
                (ahead, "version_ahead"),
            ]
            assert receiver.intake.take_refused() == []
    finally:
        receiver.close()
    assert receiver.intake.stats()["receiver/refused"] == 2
    assert np.isclose(receiver.intake.stats()["receiver/received"], 1)

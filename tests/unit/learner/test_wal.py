"""The learner's write-ahead log: what an ack promises survives a learner killed outright."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.link.protocol import encode
from common.link.receive.receiver import GroupReceiver
from common.link.receive.wal import MAGIC, WalError, WalWriter, read_segment, replay, segments, trim
from common.link.send.sender import GroupSender
from testing.transport import ANY_PORT, LIMITS, drain, make_group, start_receiver


def frame(tag: int, seq: int) -> bytes:
    return encode(make_group(tag, actor_id="a", seq=seq))


def test_append_cut_replay_trim(tmp_path: Path) -> None:
    wal = WalWriter(tmp_path)
    wal.append(frame(1, 0))
    wal.append(frame(2, 1))
    cut = wal.cut()
    wal.append(frame(3, 2))
    wal.close()
    assert [g.seq for g in replay(tmp_path, 0, LIMITS)] == [0, 1, 2]
    assert [g.seq for g in replay(tmp_path, cut, LIMITS)] == [2]
    assert trim(tmp_path, cut) == 1
    assert [n for n, _ in segments(tmp_path)] == [cut]
    # A new writer never appends to an old (possibly torn) segment.
    again = WalWriter(tmp_path)
    assert again.segment == cut + 1
    again.close()


def test_torn_tail_is_dropped_but_corruption_inside_is_an_error(tmp_path: Path) -> None:
    wal = WalWriter(tmp_path)
    wal.append(frame(1, 0))
    wal.append(frame(2, 1))
    wal.close()
    (_, path), *_ = segments(tmp_path)
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])  # killed mid-write: that record was never acked
    assert [g.seq for g in read_segment(path, LIMITS)] == [0]
    path.write_bytes(whole[:10] + b"\xff" * 20 + whole[30:])
    with pytest.raises(WalError):
        read_segment(path, LIMITS)


def test_receiver_logs_every_acked_group_before_the_cut_or_after(tmp_path: Path) -> None:
    receiver = start_receiver(wal=WalWriter(tmp_path / "wal"))
    try:
        with GroupSender(receiver.bound_address, "actor-a") as sender:
            for tag in range(5):
                sender.submit(make_group(tag))
            assert sender.flush(5.0)
            consumed = drain(receiver, 3)
            dedupe, queued, wal_from = receiver.intake.checkpoint_cut()
            for tag in range(5, 8):
                sender.submit(make_group(tag))
            assert sender.flush(5.0)
    finally:
        receiver.close()
    assert [g.seq for g in consumed] == [0, 1, 2]
    assert [g.seq for g in queued] == [3, 4]  # acked, untrained: they go into the checkpoint
    assert dedupe["actors"]["actor-a"]["floor"] == 4
    # Acked after the cut: exactly what a resumed learner replays.
    assert [g.seq for g in replay(tmp_path / "wal", wal_from, LIMITS)] == [5, 6, 7]
    assert [g.seq for g in replay(tmp_path / "wal", 0, LIMITS)] == list(range(8))


def test_replayed_groups_are_dropped_as_duplicates() -> None:
    receiver = GroupReceiver(ANY_PORT, LIMITS)
    receiver.intake.mark_seen([make_group(1, actor_id="actor-a", seq=0)])  # replayed from the log
    receiver.start()
    try:
        with GroupSender(receiver.bound_address, "actor-a") as sender:
            sender.submit(make_group(1))  # seq 0 again: the actor's resend of a logged group
            sender.submit(make_group(2))
            assert sender.flush(5.0)
        assert [g.seq for g in drain(receiver, 1)] == [1]
        assert receiver.intake.duplicates == 1
    finally:
        receiver.close()


def test_a_flipped_bit_in_a_middle_record_is_caught_by_its_crc_and_skipped(tmp_path: Path) -> None:
    wal = WalWriter(tmp_path)
    for seq in range(5):
        wal.append(frame(seq + 1, seq))
    wal.close()
    (_, path), *_ = segments(tmp_path)
    whole = bytearray(path.read_bytes())
    assert whole.startswith(MAGIC)
    offsets, offset = [], len(MAGIC)
    while offset < len(whole):
        offsets.append(offset)
        offset += 8 + int.from_bytes(whole[offset : offset + 4], "little")
    for target, what in ((offsets[2] + 20, "payload"), (offsets[2] + 1, "length field")):
        damaged = bytearray(whole)
        damaged[target] ^= 0x10
        path.write_bytes(bytes(damaged))
        # Without a handler the damage is an error, never a silent skip...
        with pytest.raises(WalError):
            read_segment(path, LIMITS)
        # ...with one, that record is reported and every other record survives.
        reported: list[str] = []
        groups = read_segment(path, LIMITS, reported.append)
        assert [g.seq for g in groups] == [0, 1, 3, 4], what
        assert len(reported) == 1 and "damaged record" in reported[0], what


def test_segments_of_the_older_format_are_still_read(tmp_path: Path) -> None:
    import struct

    path = tmp_path / "00000000.wal"
    path.write_bytes(b"".join(struct.pack("<I", len(f)) + f for f in (frame(1, 0), frame(2, 1))))
    assert [g.seq for g in replay(tmp_path, 0, LIMITS)] == [0, 1]

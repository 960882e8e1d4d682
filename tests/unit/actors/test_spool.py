"""The actor's spool: unacked groups on disk, resent by the next incarnation after a kill."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.link.send.sender import GroupSender
from common.link.send.spool import Spool, orphans
from testing.transport import drain, make_group, start_receiver


def test_frames_live_on_disk_until_acked(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "a" / "a-1")
    sender = GroupSender("tcp://127.0.0.1:1", "a-1", spool=spool).start()  # nobody listens
    try:
        for tag in range(3):
            sender.submit(make_group(tag))
        assert sorted(spool.frames()) == [0, 1, 2]
    finally:
        sender.close(timeout_s=0.0)
    receiver = start_receiver()
    try:
        # A second incarnation of "a" finds the dead one's spool and resends it as "a-1".
        spool.release()
        [(old_id, found)] = orphans(tmp_path, "a", exclude="a-2")
        assert old_id == "a-1"
        frames = found.frames()
        recovery = GroupSender(receiver.bound_address, old_id, spool=found)
        recovery.preload(frames)
        with recovery:
            assert recovery.flush(5.0)
        assert [(g.actor_id, g.seq) for g in drain(receiver, 3)] == [("a-1", s) for s in range(3)]
        assert found.frames() == {}
        found.release(delete=True)
        assert not (tmp_path / "a" / "a-1").exists()
    finally:
        receiver.close()


def test_a_live_incarnation_is_never_recovered(tmp_path: Path) -> None:
    live = Spool(tmp_path / "a" / "a-1")
    live.put(0, b"frame")
    assert orphans(tmp_path, "a", exclude="a-2") == []
    with pytest.raises(RuntimeError):
        Spool(tmp_path / "a" / "a-1")
    live.release()
    [(old_id, dead)] = orphans(tmp_path, "a", exclude="a-2")
    assert old_id == "a-1" and dead.frames() == {0: b"frame"}
    dead.release()


def test_empty_dead_spools_are_cleaned_up(tmp_path: Path) -> None:
    Spool(tmp_path / "a" / "a-1").release()
    assert orphans(tmp_path, "a", exclude="a-2") == []
    assert not (tmp_path / "a" / "a-1").exists()

"""The actor's on-disk outbox (docs/design.md §5.4): unacked groups survive an actor killed outright.

``GroupSender`` writes each group's wire frame to ``{root}/{name}/{actor_id}/{seq:012d}.frame``
before the group enters its outbox and deletes it when acked; the live incarnation holds a
``flock`` on the directory's ``lock`` file. A restarted actor (same ``name``) takes the lock of a
dead incarnation's directory and resends its frames under that ``actor_id`` and seqs; the
learner drops any it already had.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

_SUFFIX = ".frame"
_LOCK = "lock"


class Spool:
    """One incarnation's directory of unacked frames, locked while its owner lives."""

    def __init__(self, directory: Path, *, take_lock: bool = True) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._lock_fd: int | None = None
        if take_lock and not self.try_lock():
            raise RuntimeError(f"spool {directory} is in use by a live process")

    def try_lock(self) -> bool:
        """Take the exclusive lock; False if a live process holds it."""
        fd = os.open(self.directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def put(self, seq: int, frame: bytes) -> None:
        """Write a frame under a temporary name, then rename: a kill leaves it whole or absent."""
        final = self.directory / f"{seq:012d}{_SUFFIX}"
        tmp = final.with_suffix(".tmp")
        tmp.write_bytes(frame)
        tmp.replace(final)

    def remove(self, seq: int) -> None:
        (self.directory / f"{seq:012d}{_SUFFIX}").unlink(missing_ok=True)

    def frames(self) -> dict[int, bytes]:
        """Seq -> frame of every complete frame, in seq order."""
        out = {}
        for path in sorted(self.directory.glob(f"*{_SUFFIX}")):
            if path.stem.isdigit():
                out[int(path.stem)] = path.read_bytes()
        return out

    def release(self, delete: bool = False) -> None:
        """Drop the lock; with ``delete``, the directory too (only when nothing is left)."""
        if delete and not self.frames():
            shutil.rmtree(self.directory, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def orphans(root: Path, name: str, exclude: str) -> list[tuple[str, Spool]]:
    """``(actor_id, spool)`` of every dead incarnation of ``name`` (lock taken, so no other
    process recovers it at the same time); empty ones are deleted on the way."""
    found = []
    parent = root / name
    if not parent.is_dir():
        return found
    for directory in sorted(p for p in parent.iterdir() if p.is_dir() and p.name != exclude):
        spool = Spool(directory, take_lock=False)
        if not spool.try_lock():
            continue  # a live incarnation (another process with the same name)
        if not spool.frames():
            spool.release(delete=True)
            continue
        found.append((directory.name, spool))
    return found

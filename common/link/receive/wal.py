"""The learner's write-ahead log of acked groups: what makes "acked" survive a SIGKILL. Layout,
torn tails, skipped records and resynchronisation: docs/design.md §5.4.

The receiver appends every new group's wire frame here, and flushes it to the OS, before it acks
the group; so a group an actor has forgotten is always either in the newest checkpoint's pending
list or in a log segment from that checkpoint's ``wal_from`` on. Segments without the magic are
the older format, ``[length][frame]``, and are still read. The directory is fsynced when a
segment is created, so the segment itself survives a host crash with ``fsync``. A damaged record
is an error by default; a learner replaying its log passes ``on_refused`` to skip and count it.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO

from common.link.protocol import DecodeLimits, ProtocolError, TrajectoryGroup, decode

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
_HEADER = struct.Struct("<II")  # length, CRC-32 of the frame
MAGIC = b"specrlW2"
SUFFIX = ".wal"


class WalError(RuntimeError):
    """A log segment is unreadable somewhere other than its tail."""


def segments(directory: Path) -> list[tuple[int, Path]]:
    """``(number, path)`` of every segment, oldest first."""
    if not directory.is_dir():
        return []
    return sorted((int(p.stem), p) for p in directory.glob(f"*{SUFFIX}") if p.stem.isdigit())


class WalWriter:
    """Appends frames to the current segment; ``cut()`` starts the next one. Not thread-safe:
    the receiver calls it under its own lock."""

    def __init__(self, directory: Path, fsync: bool = False) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.fsync = fsync
        existing = segments(directory)
        # Never append to an old segment: its tail may be torn.
        self._number = existing[-1][0] + 1 if existing else 0
        self._file: IO[bytes] = self._open(self._number)
        self._closed = False

    def _open(self, number: int) -> IO[bytes]:
        file = (self.directory / f"{number:08d}{SUFFIX}").open("ab")
        file.write(MAGIC)
        file.flush()
        os.fsync(file.fileno())
        # The new name must survive a host crash too, not only the bytes written under it.
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return file

    @property
    def segment(self) -> int:
        return self._number

    def append(self, frame: bytes) -> None:
        """Buffer one frame; it is durable only after ``flush()``."""
        self._file.write(_HEADER.pack(len(frame), zlib.crc32(frame)))
        self._file.write(frame)

    def flush(self) -> None:
        """Hand everything appended to the OS (and to the disk with ``fsync``): once per batch
        of frames, before their acks (group commit)."""
        if self._closed:
            return
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def cut(self) -> int:
        """Close the current segment and start the next; returns the new segment's number (the
        first segment *not* covered by a checkpoint taken now)."""
        self._file.close()
        self._number += 1
        if not self._closed:
            self._file = self._open(self._number)
        return self._number

    def close(self) -> None:
        self._closed = True
        self._file.close()


OnRefused = Callable[[str], None]
"""Called with a description of each record a replay skips."""


def read_segment(
    path: Path, limits: DecodeLimits, on_refused: OnRefused | None = None
) -> list[TrajectoryGroup]:
    """The groups of one segment, each validated like a frame off the wire. A damaged record or
    one that does not decode raises WalError, or is passed to ``on_refused`` and skipped when
    one is given."""
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        return _read_v1(path, data, limits, on_refused)
    groups: list[TrajectoryGroup] = []
    offset = len(MAGIC)
    while offset < len(data):
        if _whole_record(data, offset):
            length, _ = _HEADER.unpack_from(data, offset)
            start = offset + _HEADER.size
            _decode_record(path, offset, data[start : start + length], limits, on_refused, groups)
            offset = start + length
            continue
        following = _next_record(data, offset + 1)
        if following is None:
            log.warning("%s: dropped a torn last record (%d bytes)", path, len(data) - offset)
            break
        what = f"{path}: damaged record at byte {offset} ({following - offset} bytes skipped)"
        if on_refused is None:
            raise WalError(what)
        on_refused(what)
        offset = following
    return groups


def _whole_record(data: bytes, offset: int) -> bool:
    if offset + _HEADER.size > len(data):
        return False
    length, crc = _HEADER.unpack_from(data, offset)
    start = offset + _HEADER.size
    # No frame is empty (and an empty one's CRC, 0, would match any run of zero bytes).
    return 0 < length <= len(data) - start and zlib.crc32(data[start : start + length]) == crc


def _next_record(data: bytes, offset: int) -> int | None:
    """The first offset at or after ``offset`` where a whole record with a matching CRC starts."""
    for candidate in range(offset, len(data) - _HEADER.size + 1):
        if _whole_record(data, candidate):
            return candidate
    return None


def _decode_record(
    path: Path,
    offset: int,
    frame: bytes,
    limits: DecodeLimits,
    on_refused: OnRefused | None,
    groups: list[TrajectoryGroup],
) -> None:
    try:
        message = decode(frame, limits)
        if not isinstance(message, TrajectoryGroup):
            raise ProtocolError("wrong_type", f"a {type(message).__name__}, not a group")
    except ProtocolError as e:
        what = f"{path}: record at byte {offset} does not decode: {e}"
        if on_refused is None:
            raise WalError(what) from e
        on_refused(what)
    else:
        groups.append(message)


def _read_v1(
    path: Path, data: bytes, limits: DecodeLimits, on_refused: OnRefused | None
) -> list[TrajectoryGroup]:
    """A segment of the older format (``[length][frame]``, no CRC)."""
    groups: list[TrajectoryGroup] = []
    offset = 0
    while offset < len(data):
        if offset + _LEN.size > len(data):
            break  # torn length prefix: never acked
        (length,) = _LEN.unpack_from(data, offset)
        end = offset + _LEN.size + length
        if end > len(data):
            break  # torn frame: never acked
        _decode_record(path, offset, data[offset + _LEN.size : end], limits, on_refused, groups)
        offset = end
    if offset < len(data):
        log.warning("%s: dropped a torn last record (%d bytes)", path, len(data) - offset)
    return groups


def replay(
    directory: Path, start: int, limits: DecodeLimits, on_refused: OnRefused | None = None
) -> list[TrajectoryGroup]:
    """Every group in segments numbered ``>= start``, in the order they were acked."""
    groups: list[TrajectoryGroup] = []
    for number, path in segments(directory):
        if number >= start:
            groups.extend(read_segment(path, limits, on_refused))
    return groups


def trim(directory: Path, start: int) -> int:
    """Delete the segments below ``start`` (covered by a checkpoint on disk); returns how many."""
    removed = 0
    for number, path in segments(directory):
        if number < start:
            path.unlink(missing_ok=True)
            removed += 1
    return removed

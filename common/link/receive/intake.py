"""What the learner's receiver does with each group (docs/design.md §5.2, §5.3): admission,
dedupe, write-ahead log, queue, and the acks they earn; and the counters and state the learner
reads. The socket side is common/link/receive/receiver.py: its ``GroupReceiver`` holds an
:class:`Intake`, hands it each decoded message from its I/O thread and answers the learner from
it. The intake owns the one lock its state needs; the receiver never takes it.

A refused group is acked as refused and counted, but neither logged nor queued nor recorded as
seen: the verdict depends only on the group, except ``version_ahead``, which a later learner
version may lift. A frame that does not decode is not acked at all (a correct actor never sends
one: it encodes with the same validation).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from common import metric_names as mn
from common.link.protocol import PROTOCOL_ERROR_REASONS, Heartbeat, TrajectoryGroup
from common.link.receive.admission import ADMISSION_REFUSAL_REASONS, Admission
from common.link.receive.wal import WalWriter
from common.link.transport import guarded

log = logging.getLogger(__name__)

# Receiver-level rejections on top of the codec's PROTOCOL_ERROR_REASONS.
RECEIVER_REJECT_REASONS: tuple[str, ...] = (
    "bad_envelope",  # not exactly [identity, frame] (a multipart message from the peer)
    "identity_mismatch",  # frame actor_id != connection identity
    "wrong_direction",  # an Ack sent to the learner
)
LOG_EVERY_S = 10.0
"""At most one warning of a kind per this many seconds (a flood must not flood the log)."""
_DEDUPE_FORMAT = 1
# Refused groups kept for the learner's ledger between two of its reads (it reads every step);
# beyond this a flood is still counted, not listed.
_REFUSED_LOG_MAX = 65536


@dataclasses.dataclass
class ActorInfo:
    """What the learner last heard from one actor."""

    actor_id: str
    version: int  # heartbeat version if any heartbeat came, else the newest group version
    last_seen: float  # the listening clock (Intake._listening) at the last group or heartbeat
    stats: dict[str, float]  # from the last heartbeat
    groups: int  # new groups received from it
    heartbeats: int  # heartbeats received from it


@dataclasses.dataclass
class DedupeWindow:
    """Seqs seen from one actor: all of 0..floor, plus the sparse set above it.

    Seqs arrive nearly in order, so ``above`` holds only the few groups overtaken by a resend.
    """

    floor: int = -1
    above: set[int] = dataclasses.field(default_factory=set)

    def add(self, seq: int) -> bool:
        """Record ``seq``; False if it was seen before."""
        if seq <= self.floor or seq in self.above:
            return False
        self.above.add(seq)
        while self.floor + 1 in self.above:
            self.floor += 1
            self.above.remove(self.floor)
        return True


@dataclasses.dataclass
class PendingAck:
    """What one batch of frames earns one actor: accepted seqs (ordered, each once) and refused
    seqs by reason."""

    seqs: dict[int, None] = dataclasses.field(default_factory=dict)
    refused: dict[str, list[int]] = dataclasses.field(default_factory=dict)


class Intake:
    """The receiver's state and its verdict on each group; ``get()`` yields each new group once.

    All state is guarded by ``_cond``, which the intake owns and notifies when the queue gains
    or loses a group, the batch in hand is done, or the I/O thread fails. The receiver's I/O
    thread (common/link/receive/receiver.py) calls the methods under "I/O thread" below: it
    hands over decoded messages, counts what only the socket sees, and sends the acks; the
    receiver says when that thread starts (``mark_started``), fails (``fail``) and ends
    (``close_log``), and when no more groups will come (``close``)."""

    def __init__(
        self,
        actor_timeout_s: float,
        queue_max: int,
        wal: WalWriter | None,
        admission: Admission | None,
        latest_version: Callable[[], int] | None,
    ) -> None:
        if (admission is None) != (latest_version is None):
            raise ValueError("admission and latest_version go together")
        # Condition() holds an RLock: checkpoint_cut calls dedupe_state with it held.
        self._cond = threading.Condition()
        self._started = False  # the I/O thread was started: the dedupe record is live
        self._error: BaseException | None = None  # what the I/O thread failed with
        self._actor_timeout_s = actor_timeout_s
        self._queue_max = queue_max
        self._wal = wal
        self._admission = admission
        self._latest_version = latest_version
        self._queue: deque[TrajectoryGroup] = deque()
        self._dedupe: dict[str, DedupeWindow] = {}
        self._actors: dict[str, ActorInfo] = {}
        self._received = 0
        self._duplicates = 0
        self._acks_sent = 0
        self._heartbeats = 0
        self._unauthenticated = 0
        self._disconnects = 0
        self._handover_dropped = 0
        self._bad_by_reason: dict[str, int] = dict.fromkeys(
            PROTOCOL_ERROR_REASONS + RECEIVER_REJECT_REASONS, 0
        )
        self._refused_by_reason: dict[str, int] = dict.fromkeys(ADMISSION_REFUSAL_REASONS, 0)
        # (actor_id, seq, version, reason) of refused groups not yet taken by the learner loop.
        self._refused_log: list[tuple[str, int, int, str]] = []
        self._bad_logged_at: dict[str, float] = {}
        self._bad_suppressed: dict[str, int] = {}
        self._closed = False
        # Time the I/O thread spent not reading (backpressure) stops the liveness clock: a
        # heartbeat waiting unread in the socket is not an actor gone silent.
        self._deaf_since: float | None = None
        self._deaf_total = 0.0

    # ------------------------------------------------------------------ consumer API

    def get(self, timeout_s: float) -> TrajectoryGroup | None:
        """The next new group, or None if none arrived within ``timeout_s``."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._queue or self._error is not None or self._closed, timeout_s
            )
            if self._error is not None:
                raise RuntimeError("receiver I/O thread failed") from self._error
            if not self._queue:
                return None
            group = self._queue.popleft()
            self._cond.notify_all()  # the I/O thread may be waiting for queue space
            return group

    def drain(self) -> list[TrajectoryGroup]:
        """Every queued group, without raising even if the I/O thread failed (for shutdown: the
        learner must still persist what it acked)."""
        with self._cond:
            groups = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
            return groups

    def live_actors(self) -> dict[str, ActorInfo]:
        """Actors heard from (group or heartbeat) within ``actor_timeout_s`` of listening;
        others forgotten. Time the receiver spent not reading (its queue full) does not count:
        an actor is forgotten for its silence, not for the learner's."""
        with self._cond:
            cutoff = self._listening() - self._actor_timeout_s
            for actor_id in [a for a, info in self._actors.items() if info.last_seen < cutoff]:
                del self._actors[actor_id]
            return {a: dataclasses.replace(i, stats=dict(i.stats)) for a, i in self._actors.items()}

    received = guarded("_received", "New groups queued (duplicates excluded).")
    unauthenticated = guarded(
        "_unauthenticated",
        "Handshakes refused (CURVE only): unlisted keys, wrong learner key, no CURVE.",
    )
    disconnects = guarded(
        "_disconnects",
        "Connections ended: closed or lost by the peer, or closed by libzmq (a frame over the "
        "socket's bound, which is never read, or a refused handshake).",
    )
    handover_dropped = guarded(
        "_handover_dropped",
        "Frames left on a connection an actor's reconnect took over (it resends them).",
    )
    duplicates = guarded("_duplicates", "Groups received again (acked again, not queued).")
    acks_sent = guarded("_acks_sent", "Seqs acked as accepted (a duplicate's each time).")

    @property
    def bad_frames(self) -> int:
        return sum(self.bad_frames_by_reason().values())

    def bad_frames_by_reason(self) -> dict[str, int]:
        return self._counts(self._bad_by_reason)

    def refused_by_reason(self) -> dict[str, int]:
        return self._counts(self._refused_by_reason)

    def _counts(self, by_reason: dict[str, int]) -> dict[str, int]:
        with self._cond:
            return dict(by_reason)

    def take_refused(self) -> list[tuple[str, int, int, str]]:
        """``(actor_id, seq, version, reason)`` of the groups refused since the last call (for
        the learner's ledger)."""
        with self._cond:
            taken, self._refused_log = self._refused_log, []
            return taken

    def qsize(self) -> int:
        with self._cond:
            return len(self._queue)

    def stats(self) -> dict[str, float]:
        with self._cond:
            out = {
                mn.RECEIVER_RECEIVED: float(self._received),
                mn.RECEIVER_DUPLICATES: float(self._duplicates),
                mn.RECEIVER_BAD_FRAMES: float(sum(self._bad_by_reason.values())),
                mn.RECEIVER_REFUSED: float(sum(self._refused_by_reason.values())),
                mn.RECEIVER_ACKS_SENT: float(self._acks_sent),
                mn.RECEIVER_HEARTBEATS: float(self._heartbeats),
                mn.RECEIVER_UNAUTHENTICATED: float(self._unauthenticated),
                mn.RECEIVER_DISCONNECTS: float(self._disconnects),
                mn.RECEIVER_HANDOVER_DROPPED: float(self._handover_dropped),
                mn.RECEIVER_QUEUE_SIZE: float(len(self._queue)),
            }
            for prefix, counts in (
                (mn.RECEIVER_BAD_FRAMES_PREFIX, self._bad_by_reason),
                (mn.RECEIVER_REFUSED_PREFIX, self._refused_by_reason),
            ):
                out.update({f"{prefix}{r}": float(n) for r, n in counts.items()})
        out[mn.RECEIVER_LIVE_ACTORS] = float(len(self.live_actors()))
        return out

    def _listening(self) -> float:
        """Seconds of listening: the monotonic clock less the time spent not reading (call
        with ``_cond`` held)."""
        now = time.monotonic()
        deaf = self._deaf_total + (now - self._deaf_since if self._deaf_since is not None else 0.0)
        return now - deaf

    # ------------------------------------------------------------------ lifecycle (receiver)

    def mark_started(self) -> None:
        """The I/O thread is starting: from now on the seen-seqs record is live, so
        ``load_dedupe_state`` and ``mark_seen`` refuse."""
        with self._cond:
            self._started = True

    def _require_not_started(self, what: str) -> None:
        with self._cond:
            if self._started:
                raise RuntimeError(f"{what} must be called before start()")

    def fail(self, error: BaseException) -> None:
        """The I/O thread failed with ``error``: ``get`` raises it from now on."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def close_log(self) -> None:
        """The I/O thread ended: nothing more goes to the write-ahead log."""
        if self._wal is not None:
            self._wal.close()

    def close(self) -> None:
        """No more groups will come: wake ``get`` callers, and warn of groups left unread."""
        with self._cond:
            self._closed = True
            left = len(self._queue)
            self._cond.notify_all()
        if left:
            # Acked on receipt, so unless the caller drains them these are lost to training.
            log.warning("receiver closed with %d acked group(s) not yet consumed", left)

    # ------------------------------------------------------------------ dedupe persistence

    def dedupe_state(self) -> dict[str, Any]:
        """Seqs seen per actor, JSON/msgpack-serialisable, for the learner checkpoint."""
        with self._cond:  # re-entrant use from checkpoint_cut: _cond's lock is an RLock
            return {
                "format": _DEDUPE_FORMAT,
                "actors": {
                    actor_id: {"floor": w.floor, "above": sorted(w.above)}
                    for actor_id, w in self._dedupe.items()
                },
            }

    def checkpoint_cut(self) -> tuple[dict[str, Any], list[TrajectoryGroup], int | None]:
        """One consistent cut for a checkpoint: ``(dedupe state, groups queued but not yet
        consumed, first log segment after the cut)``.

        Taken under the receiver's lock, so every group acked so far is either in the returned
        queue copy (or already consumed by the caller) or, if acked later, in a log segment from
        the returned number on. The segment is None without a log.
        """
        with self._cond:
            wal_from = self._wal.cut() if self._wal is not None else None
            return self.dedupe_state(), list(self._queue), wal_from

    def load_dedupe_state(self, state: dict[str, Any]) -> None:
        """Replace the seen-seqs record with one from ``dedupe_state()`` (checkpoint restore).

        ``{}`` means nothing seen. Raises ValueError on anything malformed. Must be called
        before ``start()``: a group accepted before the load would be judged against the wrong
        record (a resend of an already-trained group would be trained on again).
        """
        self._require_not_started("load_dedupe_state")
        if not state:
            # A fresh run's checkpoint holds no dedupe record yet.
            with self._cond:
                self._dedupe = {}
            return
        if state.get("format") != _DEDUPE_FORMAT or not isinstance(state.get("actors"), dict):
            raise ValueError(f"not a dedupe state (format {_DEDUPE_FORMAT}): {state!r:.200}")
        windows: dict[str, DedupeWindow] = {}
        for actor_id, entry in state["actors"].items():
            if not isinstance(entry, dict) or entry.keys() != {"floor", "above"}:
                raise ValueError(f"bad dedupe entry for {actor_id!r}: {entry!r:.200}")
            floor, above = entry["floor"], entry["above"]
            if (
                type(floor) is not int
                or floor < -1
                or not isinstance(above, list)
                or not all(type(s) is int and s > floor for s in above)
            ):
                raise ValueError(f"bad dedupe entry for {actor_id!r}: {entry!r:.200}")
            window = DedupeWindow(floor=floor)
            for seq in above:
                window.add(seq)
            windows[str(actor_id)] = window
        with self._cond:
            self._dedupe = windows

    def mark_seen(self, groups: list[TrajectoryGroup]) -> None:
        """Record groups replayed from the write-ahead log as seen (before ``start()``), so the
        actors' resends of them are acked as duplicates."""
        self._require_not_started("mark_seen")
        with self._cond:
            for group in groups:
                self._dedupe.setdefault(group.actor_id, DedupeWindow()).add(group.seq)

    # ------------------------------------------------------------------ I/O thread

    def queue_full(self) -> bool:
        """True while the queue is full, the I/O thread then reading nothing; the time it
        spends so is kept off the liveness clock (``_listening``)."""
        now = time.monotonic()
        with self._cond:
            full = len(self._queue) >= self._queue_max
            if full and self._deaf_since is None:
                self._deaf_since = now
            elif not full and self._deaf_since is not None:
                self._deaf_total += now - self._deaf_since
                self._deaf_since = None
            return full

    def wait_for_space(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` for ``get`` (or anything else) to notify: the queue may
        have room again."""
        with self._cond:
            self._cond.wait(timeout_s)

    def batch_done(self) -> None:
        """Wake the consumer once for a batch of groups (not once per group)."""
        with self._cond:
            self._cond.notify_all()

    def flush_log(self) -> None:
        """Make the write-ahead log hold every group accepted so far, before their acks go
        out (a write error raises: nothing unlogged is acked)."""
        if self._wal is not None:
            with self._cond:
                self._wal.flush()

    def count_acks_sent(self, seqs: int) -> None:
        with self._cond:
            self._acks_sent += seqs

    def count_handover_dropped(self) -> None:
        with self._cond:
            self._handover_dropped += 1

    def count_disconnect(self) -> None:
        with self._cond:
            self._disconnects += 1

    def count_unauthenticated(self) -> None:
        with self._cond:
            self._unauthenticated += 1

    # ------------------------------------------------------------------ one message

    def on_group(self, group: TrajectoryGroup, frame: bytes, ack: PendingAck) -> bool:
        """Refuse, or accept (queue and log a new one), a group that decoded on the connection
        of its actor, adding its seq to ``ack``; True if the queue is now full."""
        if self._admission is not None:
            refusal = self._admission.refusal(group, self._latest_version())
            if refusal is not None:
                self._refuse(group, refusal.reason, refusal.detail, ack)
                return False
        with self._cond:
            info = self._touch(group.actor_id)
            # A group's version is the oldest of its tokens; a heartbeat's is authoritative.
            if info.heartbeats == 0:
                info.version = max(info.version, group.version)
            if self._dedupe.setdefault(group.actor_id, DedupeWindow()).add(group.seq):
                if self._wal is not None:
                    self._wal.append(frame)  # flushed in _send_acks, before the ack goes out
                self._queue.append(group)
                self._received += 1
                info.groups += 1
            else:
                self._duplicates += 1
            full = len(self._queue) >= self._queue_max
        # Ack on receipt (also re-ack duplicates: the first ack may have been lost).
        ack.seqs[group.seq] = None  # ordered, once each
        return full

    def _refuse(self, group: TrajectoryGroup, reason: str, detail: str, ack: PendingAck) -> None:
        with self._cond:
            self._touch(group.actor_id)
            self._refused_by_reason[reason] = self._refused_by_reason.get(reason, 0) + 1
            if len(self._refused_log) < _REFUSED_LOG_MAX:
                self._refused_log.append((group.actor_id, group.seq, group.version, reason))
        ack.refused.setdefault(reason, []).append(group.seq)
        self.log_limited(
            f"refused/{reason}",
            "refused group %s/%d: %s (%s)",
            group.actor_id,
            group.seq,
            reason,
            detail[:200],
        )

    def on_heartbeat(self, beat: Heartbeat) -> None:
        with self._cond:
            self._heartbeats += 1
            info = self._touch(beat.actor_id)
            info.version = beat.version
            info.stats = beat.stats
            info.heartbeats += 1

    def _touch(self, actor_id: str) -> ActorInfo:
        info = self._actors.get(actor_id)
        if info is None:
            info = ActorInfo(
                actor_id=actor_id, version=0, last_seen=0.0, stats={}, groups=0, heartbeats=0
            )
            self._actors[actor_id] = info
        info.last_seen = self._listening()
        return info

    def log_limited(self, kind: str, fmt: str, *args: object) -> None:
        """Log a warning at most once per ``LOG_EVERY_S`` per kind, counting the suppressed."""
        now = time.monotonic()
        with self._cond:
            last = self._bad_logged_at.get(kind)
            if last is not None and now - last < LOG_EVERY_S:
                self._bad_suppressed[kind] = self._bad_suppressed.get(kind, 0) + 1
                return
            self._bad_logged_at[kind] = now
            suppressed = self._bad_suppressed.pop(kind, 0)
        if suppressed:
            fmt += f"; {suppressed} more like it in the last {LOG_EVERY_S:.0f} s"
        log.warning(fmt, *args)

    def reject(self, identity: bytes, reason: str, detail: str) -> None:
        with self._cond:
            self._bad_by_reason[reason] = self._bad_by_reason.get(reason, 0) + 1
        peer = identity.decode("utf-8", errors="backslashreplace")
        self.log_limited(reason, "bad frame from %r: %s (%s)", peer, reason, detail[:200])

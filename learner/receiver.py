"""The learner's end of the delivery contract (docs/design.md §5.2): validate, dedupe, queue, ack.

Identity: every actor's DEALER identity is its ``actor_id`` (UTF-8). A group or heartbeat whose
``actor_id`` differs from the identity of the connection it came on is rejected
("identity_mismatch", not acked): acks are routed by identity and dedupe is keyed by actor_id,
so tying the two stops one peer from filling (or acking away) another actor's seqs; with CURVE
the identity can later be bound to the authenticated key.

Acks are sent on receipt: a new group is written to the write-ahead log (``wal``, see
learner/wal.py), queued, then acked; a duplicate is only acked again. With the log the ack
promises "in this learner's log" (durable against a learner killed outright; against a host
crash too with fsync); without it, only "in this learner's memory".

Authentication: with ``curve`` the link is CurveZMQ; with ``authorized_keys`` too, a ZAP handler
admits only clients whose public key is a ``*.key`` certificate in that directory (re-read when
the directory changes, so revoking a key is deleting its file). Every refused handshake (a key
not listed, a client without the learner's public key, a client without CURVE) is counted as
``receiver/unauthenticated`` and logged.

Admission: a group that decodes but that this run cannot train on (learner/admission.py: wrong
group size, too long, reward out of range, version ahead of the learner) is *refused*: acked in
the ack's ``refused`` map, so the actor drops it instead of resending it forever, counted as
``receiver/refused/{reason}``, and neither logged nor queued nor recorded as seen (the verdict
depends only on the group, except ``version_ahead``, which a later learner version may lift). A frame that does not decode is not acked at all (a correct actor never sends one: it
encodes with the same validation).

Backpressure: when ``queue_max`` groups wait for ``get()``, the I/O thread stops reading the
socket altogether. Unread frames stay in zmq's bounded pipes (HWM), actors get no acks, their
outboxes fill and ``submit`` blocks. Memory stays bounded; heartbeats are not read meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from common.curve_keys import CurveKeys
from common.protocol import (
    PROTOCOL_ERROR_REASONS,
    Ack,
    DecodeLimits,
    Heartbeat,
    ProtocolError,
    TrajectoryGroup,
    decode,
    encode,
)
from common.transport import DEFAULT_HWM, bind_router, bound_endpoint, shared_context
from learner.admission import ADMISSION_REFUSAL_REASONS, Admission
from learner.wal import WalWriter

log = logging.getLogger(__name__)

# Handshakes a CURVE server refuses: ZAP said no (key not listed), the CURVE exchange failed (the
# client does not know the learner's public key), or the client speaks another mechanism.
_REFUSED_EVENTS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key not authorized",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "CURVE handshake failed (wrong learner key or no CURVE)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
}

# Receiver-level rejections on top of the codec's PROTOCOL_ERROR_REASONS.
RECEIVER_REJECT_REASONS: tuple[str, ...] = (
    "bad_envelope",  # not exactly [identity, frame] (a multipart message from the peer)
    "identity_mismatch",  # frame actor_id != connection identity
    "wrong_direction",  # an Ack sent to the learner
)
# Acks are ~60-byte frames, at most one per actor per batch; a ROUTER drops replies beyond its
# send HWM (and each dropped ack costs the actor a resend timeout), so give them room.
_ACK_HWM = 4096
_POLL_S = 0.05  # bounds how long close() waits for the I/O thread
_MAX_BATCH = 256  # frames handled per wake-up before re-checking stop/backpressure
_BAD_LOG_EVERY_S = 10.0
_DEDUPE_FORMAT = 1
# Refused groups kept for the learner's ledger between two of its reads (it reads every step);
# beyond this a flood is still counted, not listed.
_REFUSED_LOG_MAX = 65536


@dataclasses.dataclass
class ActorInfo:
    """What the learner last heard from one actor."""

    actor_id: str
    version: int  # heartbeat version if any heartbeat came, else the newest group version
    last_seen: float  # time.monotonic() of the last group or heartbeat
    stats: dict[str, float]  # from the last heartbeat
    groups: int  # new groups received from it
    heartbeats: int  # heartbeats received from it


@dataclasses.dataclass
class _DedupeWindow:
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
class _PendingAck:
    """What one batch of frames earns one actor: accepted seqs (ordered, each once) and refused
    seqs by reason."""

    seqs: dict[int, None] = dataclasses.field(default_factory=dict)
    refused: dict[str, list[int]] = dataclasses.field(default_factory=dict)


class GroupReceiver:
    """Receives TrajectoryGroups and heartbeats on a ROUTER; ``get()`` yields each group once."""

    def __init__(
        self,
        bind_address: str,
        limits: DecodeLimits,
        actor_timeout_s: float = 30.0,
        queue_max: int = 1024,
        *,
        hwm: int = DEFAULT_HWM,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
        authorized_keys: Path | None = None,
        wal: WalWriter | None = None,
        admission: Admission | None = None,
        latest_version: Callable[[], int] | None = None,
    ) -> None:
        """``curve``: the learner's CurveZMQ key pair; peers without its public key get nothing
        through. ``authorized_keys``: a directory of actor public-key certificates; with it only
        those actors get through. ``wal``: the write-ahead log every new group goes to before
        its ack. ``admission`` with ``latest_version`` (the learner's newest version, read at
        each group): groups it refuses are acked as refused and never queued."""
        if (admission is None) != (latest_version is None):
            raise ValueError("admission and latest_version go together")
        if authorized_keys is not None and curve is None:
            raise ValueError("authorized_keys needs curve (the allow-list is of CURVE keys)")
        if authorized_keys is not None and not Path(authorized_keys).is_dir():
            raise FileNotFoundError(f"authorized_keys directory {authorized_keys} does not exist")
        if queue_max < 1:
            raise ValueError(f"queue_max must be >= 1, got {queue_max}")
        if actor_timeout_s <= 0:
            raise ValueError(f"actor_timeout_s must be > 0, got {actor_timeout_s}")
        self._bind_address = bind_address
        self._limits = limits
        self._actor_timeout_s = actor_timeout_s
        self._queue_max = queue_max
        self._hwm = hwm
        self._curve = curve
        self._allow_list = _AllowList(Path(authorized_keys)) if authorized_keys else None
        self._wal = wal
        self._admission = admission
        self._latest_version = latest_version
        # ZAP handlers are per context: a receiver with an allow-list gets a context of its own.
        self._own_context = self._allow_list is not None and context is None
        self._context = zmq.Context() if self._own_context else (context or shared_context())
        self._authenticator: ThreadAuthenticator | None = None

        # _cond guards everything below; notified when the queue gains or loses a group.
        self._cond = threading.Condition()
        self._queue: deque[TrajectoryGroup] = deque()
        self._dedupe: dict[str, _DedupeWindow] = {}
        self._actors: dict[str, ActorInfo] = {}
        self._received = 0
        self._duplicates = 0
        self._acks_sent = 0
        self._heartbeats = 0
        self._unauthenticated = 0
        self._handover_dropped = 0
        self._bad_by_reason: dict[str, int] = dict.fromkeys(
            PROTOCOL_ERROR_REASONS + RECEIVER_REJECT_REASONS, 0
        )
        self._refused_by_reason: dict[str, int] = dict.fromkeys(ADMISSION_REFUSAL_REASONS, 0)
        # (actor_id, seq, version, reason) of refused groups not yet taken by the learner loop.
        self._refused_log: list[tuple[str, int, int, str]] = []
        self._bad_logged_at: dict[str, float] = {}
        self._bad_suppressed: dict[str, int] = {}
        self._error: BaseException | None = None
        self._closed = False

        self._bound_address: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> GroupReceiver:
        if self._thread is not None:
            raise RuntimeError("GroupReceiver already started")
        if self._allow_list is not None:
            self._authenticator = ThreadAuthenticator(
                self._context, log=logging.getLogger(f"{__name__}.zap")
            )
            self._authenticator.start()
            self._authenticator.configure_curve_callback(
                domain="*", credentials_provider=self._allow_list
            )
        # Bound here so a bind error raises in the caller and bound_address is ready on return.
        sock = bind_router(
            self._bind_address,
            max_frame_bytes=self._limits.max_frame_bytes,
            hwm=self._hwm,
            sndhwm=_ACK_HWM,
            context=self._context,
            curve_secret_key=self._curve.secret if self._curve else None,
            curve_public_key=self._curve.public if self._curve else None,
        )
        self._bound_address = bound_endpoint(sock)
        monitor = (
            sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            )
            if self._curve is not None
            else None
        )
        self._thread = threading.Thread(
            target=self._run, args=(sock, monitor), name="group-receiver", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop receiving and release the port. Queued groups stay readable with ``get``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        if self._own_context:
            self._context.term()
            self._own_context = False
        with self._cond:
            self._closed = True
            left = len(self._queue)
            self._cond.notify_all()
        if left:
            # Acked on receipt, so unless the caller drains them these are lost to training.
            log.warning("receiver closed with %d acked group(s) not yet consumed", left)

    def __enter__(self) -> GroupReceiver:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def bound_address(self) -> str:
        """The concrete endpoint (a ``:*`` / port-0 bind resolved), valid after ``start()``."""
        if self._bound_address is None:
            raise RuntimeError("GroupReceiver not started")
        return self._bound_address

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
        """Actors heard from (group or heartbeat) within ``actor_timeout_s``; others forgotten."""
        cutoff = time.monotonic() - self._actor_timeout_s
        with self._cond:
            for actor_id in [a for a, info in self._actors.items() if info.last_seen < cutoff]:
                del self._actors[actor_id]
            return {a: dataclasses.replace(i, stats=dict(i.stats)) for a, i in self._actors.items()}

    @property
    def received(self) -> int:
        """New groups queued (duplicates excluded)."""
        with self._cond:
            return self._received

    @property
    def unauthenticated(self) -> int:
        """Handshakes refused (CURVE only): unlisted keys, wrong learner key, no CURVE."""
        with self._cond:
            return self._unauthenticated

    @property
    def duplicates(self) -> int:
        with self._cond:
            return self._duplicates

    @property
    def acks_sent(self) -> int:
        with self._cond:
            return self._acks_sent

    @property
    def bad_frames(self) -> int:
        with self._cond:
            return sum(self._bad_by_reason.values())

    def bad_frames_by_reason(self) -> dict[str, int]:
        with self._cond:
            return dict(self._bad_by_reason)

    def refused_by_reason(self) -> dict[str, int]:
        with self._cond:
            return dict(self._refused_by_reason)

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
                "receiver/received": float(self._received),
                "receiver/duplicates": float(self._duplicates),
                "receiver/bad_frames": float(sum(self._bad_by_reason.values())),
                "receiver/refused": float(sum(self._refused_by_reason.values())),
                "receiver/acks_sent": float(self._acks_sent),
                "receiver/heartbeats": float(self._heartbeats),
                "receiver/unauthenticated": float(self._unauthenticated),
                "receiver/handover_dropped": float(self._handover_dropped),
                "receiver/queue_size": float(len(self._queue)),
            }
            out.update(
                {f"receiver/bad_frames/{r}": float(n) for r, n in self._bad_by_reason.items()}
            )
            out.update(
                {f"receiver/refused/{r}": float(n) for r, n in self._refused_by_reason.items()}
            )
        out["receiver/live_actors"] = float(len(self.live_actors()))
        return out

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
        if self._thread is not None:
            raise RuntimeError("load_dedupe_state must be called before start()")
        if not state:
            # A fresh run's checkpoint holds no dedupe record yet.
            with self._cond:
                self._dedupe = {}
            return
        if state.get("format") != _DEDUPE_FORMAT or not isinstance(state.get("actors"), dict):
            raise ValueError(f"not a dedupe state (format {_DEDUPE_FORMAT}): {state!r:.200}")
        windows: dict[str, _DedupeWindow] = {}
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
            window = _DedupeWindow(floor=floor)
            for seq in above:
                window.add(seq)
            windows[str(actor_id)] = window
        with self._cond:
            self._dedupe = windows

    def mark_seen(self, groups: list[TrajectoryGroup]) -> None:
        """Record groups replayed from the write-ahead log as seen (before ``start()``), so the
        actors' resends of them are acked as duplicates."""
        if self._thread is not None:
            raise RuntimeError("mark_seen must be called before start()")
        with self._cond:
            for group in groups:
                self._dedupe.setdefault(group.actor_id, _DedupeWindow()).add(group.seq)

    # ------------------------------------------------------------------ I/O thread

    def _run(self, sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
        try:
            self._loop(sock, monitor)
        except BaseException as e:
            # Thread boundary: hand the failure to the consumer (get() raises it).
            log.exception("receiver I/O thread failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            if self._wal is not None:
                self._wal.close()
            sock.close()

    def _loop(self, sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        while not self._stop.is_set():
            with self._cond:
                full = len(self._queue) >= self._queue_max
            if full:
                # Backpressure: read nothing (so ack nothing) until get() frees space.
                if monitor is not None:
                    self._drain_monitor(monitor)
                with self._cond:
                    self._cond.wait(_POLL_S)
                continue
            ready = dict(poller.poll(int(_POLL_S * 1000)))
            if monitor is not None and monitor in ready:
                self._drain_monitor(monitor)
            if sock not in ready:
                continue
            acks: dict[bytes, _PendingAck] = {}
            for _ in range(_MAX_BATCH):
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if self._handle(parts, acks):
                    break
            if acks:
                with self._cond:
                    self._cond.notify_all()  # once per batch: the consumer wakes to many groups
            self._send_acks(sock, acks)

    def _send_acks(self, sock: zmq.Socket, acks: dict[bytes, _PendingAck]) -> None:
        """One Ack per actor for the whole batch, after the log has the batch (group commit)."""
        if not acks:
            return
        if self._wal is not None:
            with self._cond:
                self._wal.flush()  # a write error fails the I/O thread: nothing unlogged is acked
        limit = self._limits.max_ack_seqs
        for identity, pending in acks.items():
            actor_id = identity.decode("utf-8")
            ordered = list(pending.seqs)
            for start in range(0, len(ordered), limit):
                chunk = ordered[start : start + limit]
                sock.send_multipart([identity, encode(Ack(actor_id=actor_id, seqs=chunk))])
            for reason, seqs in pending.refused.items():
                for start in range(0, len(seqs), limit):
                    refused = {reason: seqs[start : start + limit]}
                    ack = Ack(actor_id=actor_id, seqs=[], refused=refused)
                    sock.send_multipart([identity, encode(ack)])
        with self._cond:
            self._acks_sent += sum(len(p.seqs) for p in acks.values())

    def _handle(self, parts: list[bytes], acks: dict[bytes, _PendingAck]) -> bool:
        """Process one ROUTER message, adding any ack it earns to ``acks``; True if the queue
        is now full (stop reading)."""
        identity = parts[0]
        if identity.startswith(b"\x00"):
            # libzmq renames a connection that a reconnecting peer took its identity from
            # (ROUTER_HANDOVER) to a NUL-led id; frames still buffered on that old connection
            # arrive under it. Actors cannot choose such ids, an ack could not reach them, and
            # the actor resends them on its new connection: drop them, counted apart.
            with self._cond:
                self._handover_dropped += 1
            return False
        if len(parts) != 2:
            self._reject(identity, "bad_envelope", f"{len(parts) - 1} frames")
            return False
        try:
            msg = decode(parts[1], self._limits)
        except ProtocolError as e:
            # I/O boundary: count, log, keep serving; the sender resends anything unacked.
            self._reject(identity, e.reason, e.detail)
            return False
        if isinstance(msg, Ack):
            self._reject(identity, "wrong_direction", "Ack sent to the learner")
            return False
        if msg.actor_id.encode("utf-8") != identity:
            self._reject(identity, "identity_mismatch", f"frame says {msg.actor_id!r}")
            return False
        if isinstance(msg, Heartbeat):
            self._on_heartbeat(msg)
            return False
        if self._admission is not None:
            refusal = self._admission.refusal(msg, self._latest_version())
            if refusal is not None:
                self._refuse(identity, msg, refusal.reason, refusal.detail, acks)
                return False
        return self._accept_group(identity, msg, parts[1], acks)

    def _refuse(
        self,
        identity: bytes,
        group: TrajectoryGroup,
        reason: str,
        detail: str,
        acks: dict[bytes, _PendingAck],
    ) -> None:
        with self._cond:
            self._touch(group.actor_id)
            self._refused_by_reason[reason] = self._refused_by_reason.get(reason, 0) + 1
            if len(self._refused_log) < _REFUSED_LOG_MAX:
                self._refused_log.append((group.actor_id, group.seq, group.version, reason))
        acks.setdefault(identity, _PendingAck()).refused.setdefault(reason, []).append(group.seq)
        self._log_limited(
            f"refused/{reason}",
            "refused group %s/%d: %s (%s)",
            group.actor_id,
            group.seq,
            reason,
            detail[:200],
        )

    def _on_heartbeat(self, beat: Heartbeat) -> None:
        with self._cond:
            self._heartbeats += 1
            info = self._touch(beat.actor_id)
            info.version = beat.version
            info.stats = beat.stats
            info.heartbeats += 1

    def _accept_group(
        self,
        identity: bytes,
        group: TrajectoryGroup,
        frame: bytes,
        acks: dict[bytes, _PendingAck],
    ) -> bool:
        with self._cond:
            info = self._touch(group.actor_id)
            # A group's version is the oldest of its tokens; a heartbeat's is authoritative.
            if info.heartbeats == 0:
                info.version = max(info.version, group.version)
            window = self._dedupe.setdefault(group.actor_id, _DedupeWindow())
            is_new = window.add(group.seq)
            if is_new:
                if self._wal is not None:
                    self._wal.append(frame)  # flushed in _send_acks, before the ack goes out
                self._queue.append(group)
                self._received += 1
                info.groups += 1
            else:
                self._duplicates += 1
            full = len(self._queue) >= self._queue_max
        # Ack on receipt (also re-ack duplicates: the first ack may have been lost).
        acks.setdefault(identity, _PendingAck()).seqs[group.seq] = None  # ordered, once each
        return full

    def _touch(self, actor_id: str) -> ActorInfo:
        info = self._actors.get(actor_id)
        if info is None:
            info = ActorInfo(
                actor_id=actor_id, version=0, last_seen=0.0, stats={}, groups=0, heartbeats=0
            )
            self._actors[actor_id] = info
        info.last_seen = time.monotonic()
        return info

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            reason = _REFUSED_EVENTS.get(event["event"])
            if reason is None:
                continue
            with self._cond:
                self._unauthenticated += 1
            self._log_limited(
                "unauthenticated",
                "refused a connection to %s: %s",
                event.get("endpoint", b"?"),
                reason,
            )

    def _log_limited(self, kind: str, fmt: str, *args: object) -> None:
        """Log a warning at most once per ``_BAD_LOG_EVERY_S`` per kind, with a count of the
        suppressed ones (a flood must not flood the log)."""
        now = time.monotonic()
        with self._cond:
            last = self._bad_logged_at.get(kind)
            if last is not None and now - last < _BAD_LOG_EVERY_S:
                self._bad_suppressed[kind] = self._bad_suppressed.get(kind, 0) + 1
                return
            self._bad_logged_at[kind] = now
            suppressed = self._bad_suppressed.pop(kind, 0)
        if suppressed:
            fmt += f"; {suppressed} more like it in the last {_BAD_LOG_EVERY_S:.0f} s"
        log.warning(fmt, *args)

    def _reject(self, identity: bytes, reason: str, detail: str) -> None:
        with self._cond:
            self._bad_by_reason[reason] = self._bad_by_reason.get(reason, 0) + 1
        peer = identity.decode("utf-8", errors="backslashreplace")
        self._log_limited(reason, "bad frame from %r: %s (%s)", peer, reason, detail[:200])


class _AllowList:
    """ZAP credentials provider: the CURVE public keys of the ``*.key`` certificates in a
    directory, re-read whenever the directory changes (adding or deleting a file)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._stamp: int | None = None
        self._keys: set[bytes] = set()
        self._lock = threading.Lock()
        self._logged_at: dict[bytes, float] = {}  # refused key -> last warning

    def _reload(self) -> None:
        stamp = self.directory.stat().st_mtime_ns
        if stamp != self._stamp:
            self._keys = set(zmq.auth.load_certificates(str(self.directory)))
            self._stamp = stamp
            log.info("CURVE allow-list: %d key(s) from %s", len(self._keys), self.directory)

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's Authenticator calls this with the client's z85 public key."""
        with self._lock:
            try:
                self._reload()
            except OSError as e:  # directory gone: admit nobody rather than everybody
                log.error("CURVE allow-list %s unreadable (%s); refusing", self.directory, e)
                self._keys = set()
                self._stamp = None
            allowed = key in self._keys
            now = time.monotonic()
            quiet = now - self._logged_at.get(key, -_BAD_LOG_EVERY_S) < _BAD_LOG_EVERY_S
            if not allowed and not quiet:
                self._logged_at[key] = now
        if not allowed and not quiet:
            log.warning("refused CURVE client key %s: not in %s", key.decode(), self.directory)
        return allowed

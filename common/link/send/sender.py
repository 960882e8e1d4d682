"""The actor's end of the delivery contract (docs/design.md §5.2): outbox, acks, resend, heartbeats.

Resend triggers: a group still unacked ``resend_timeout_s`` after its last send, and a
reconnect. The DEALER runs with IMMEDIATE, so frames are only queued onto a live connection;
frames written to a connection that then died may be lost, so on the first completed handshake
after an ``EVENT_DISCONNECTED`` (seen by a socket monitor) every group already sent is sent again
at once. The timeout stays the backstop for what the monitor cannot see (a learner that lost a
group, a dropped ack). A group the learner refuses leaves the outbox like an acked one and is
counted by reason and logged: resending it could never succeed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections import OrderedDict, deque

import zmq
from zmq.utils.monitor import recv_monitor_message

from common import metric_names as mn
from common.curve_keys import CurveKeys
from common.link.protocol import (
    Ack,
    DecodeLimits,
    Heartbeat,
    ProtocolError,
    TrajectoryGroup,
    decode,
    encode,
)
from common.link.send.spool import Spool
from common.link.transport import (
    DEFAULT_MAX_FRAME_BYTES,
    SocketThread,
    connect_dealer,
    guarded,
    ready,
    shared_context,
)

log = logging.getLogger(__name__)

# While a send is refused (no connection yet, or the pipe is at its high-water mark) the I/O
# thread retries this often; the connect event wakes it sooner in the common case.
_BLOCKED_RETRY_S = 0.05
# Upper bound on one poll, so a missed wake-up costs at most this much latency.
_MAX_POLL_S = 0.5
# Acks carry no token ids; the sender decodes nothing else.
_ACK_LIMITS = DecodeLimits(vocab_size=1)


def unique_actor_id(name: str) -> str:
    """``name`` plus a random suffix, for one sender's lifetime.

    Seqs restart at 0 in every GroupSender, so an actor process restarted under its old
    actor_id would see its new groups acked-and-dropped as duplicates by a learner that
    remembers the old seqs. A fresh id per process incarnation avoids that.
    """
    return f"{name}-{secrets.token_hex(4)}"


@dataclasses.dataclass
class _Entry:
    frame: bytes
    sends: int = 0
    last_sent: float | None = None  # time.monotonic() of the last send; None: (re)send now


class GroupSender(SocketThread):
    """Sends TrajectoryGroups to the learner's ROUTER with acks and resends; thread-safe.

    A background thread owns the DEALER socket; ``submit`` only touches the outbox (under a
    lock) and rings an inproc doorbell, because zmq sockets must not be shared across threads.
    The DEALER identity is ``actor_id`` (the receiver requires them to match).
    """

    def __init__(
        self,
        address: str,
        actor_id: str,
        *,
        outbox_max: int = 64,
        resend_timeout_s: float = 10.0,
        heartbeat_interval_s: float = 2.0,
        limits: DecodeLimits | None = None,
        curve: CurveKeys | None = None,
        spool: Spool | None = None,
    ) -> None:
        """``limits``: if given, ``submit`` also runs the receiver's full validation, so a group
        the learner would reject (e.g. out-of-vocab ids) fails in ``submit`` instead of being
        resent forever. ``spool``: every unacked frame is also kept there (common/link/send/spool.py)."""
        identity = actor_id.encode("utf-8")
        if not 1 <= len(identity) <= 255 or identity.startswith(b"\x00"):
            raise ValueError(f"actor_id must be 1..255 UTF-8 bytes, not NUL-led: {actor_id!r}")
        self.address = address
        self.actor_id = actor_id
        self._identity = identity
        self._outbox_max = outbox_max
        self._resend_timeout_s = resend_timeout_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._limits = limits
        self._curve = curve  # CurveZMQ client keys, with the learner's public key
        self._spool = spool
        self._max_frame_bytes = limits.max_frame_bytes if limits else DEFAULT_MAX_FRAME_BYTES
        self._context = shared_context()
        # _cond guards the outbox, counters, status and lifecycle flags; it is notified when
        # acks free outbox space, and when the I/O thread stops or fails.
        super().__init__("sender", f"group-sender-{actor_id}")
        self._outbox: OrderedDict[int, _Entry] = OrderedDict()
        # Seqs due for a send, oldest first. Invariant: an entry's last_sent is None exactly
        # while its seq is queued here (acked seqs are skipped when they come up).
        self._unsent: deque[int] = deque()
        # The outbox is scanned for timed-out entries this often, not on every wake-up.
        self._scan_interval_s = min(0.25, resend_timeout_s / 4)
        self._next_scan = 0.0  # I/O thread only
        self._next_seq = 0
        self._acked_total = 0
        self._refused: dict[str, int] = {}
        self._resent_total = 0
        self._bad_replies = 0
        self._connects = 0
        self._reconnects = 0
        self._blocked_s = 0.0  # time submit() waited for outbox space (under _cond)
        self._link_lost = False  # a DISCONNECTED event since the last handshake (I/O thread)
        self._status_version = 0
        self._status_stats: dict[str, float] = {}
        self._closed = False
        # Serialises submitters so a seq is consumed only once its frame is in the outbox:
        # a seq gap would keep the learner's dedupe window from ever compacting.
        self._submit_lock = threading.Lock()

        self._doorbell_addr = f"inproc://specrl-sender-{id(self)}-{secrets.token_hex(4)}"
        self._doorbell_lock = threading.Lock()
        self._doorbell_tx: zmq.Socket | None = None

    # ------------------------------------------------------------------ lifecycle

    def preload(self, frames: dict[int, bytes]) -> None:
        """Queue frames already encoded under this ``actor_id`` (a dead incarnation's spool),
        keeping their seqs; before ``start()``. New submits continue after the highest seq."""
        self._require_not_started("preload")
        with self._cond:
            for seq, frame in sorted(frames.items()):
                self._enqueue(seq, frame)

    def start(self) -> GroupSender:
        self._require_not_started()
        # Built here, before the thread starts (a full memory barrier), then used only by it.
        curve = self._curve
        sock = connect_dealer(
            self.address,
            self._identity,
            context=self._context,
            curve_secret_key=curve.secret if curve else None,
            curve_public_key=curve.public if curve else None,
            curve_server_key=curve.server_public if curve else None,
        )
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        doorbell_rx = self._context.socket(zmq.PAIR)
        doorbell_rx.bind(self._doorbell_addr)
        tx = self._context.socket(zmq.PAIR)
        tx.setsockopt(zmq.LINGER, 0)
        tx.connect(self._doorbell_addr)
        self._doorbell_tx = tx
        self._spawn(sock, monitor, doorbell_rx)
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait up to ``timeout_s`` for outstanding acks, then stop; never raises on unacked.
        A second call does nothing."""
        with self._cond:
            if self._closed:
                return
        if self._thread is not None and self._error is None:
            self.flush(timeout_s)
        with self._cond:
            self._closed = True
            left = len(self._outbox)
            self._cond.notify_all()
        self._stop.set()
        self._ring()
        if self._thread is not None:
            self._thread.join()
        with self._doorbell_lock:
            if self._doorbell_tx is not None:
                self._doorbell_tx.close(linger=0)
                self._doorbell_tx = None
        if left:
            # Not silent: the groups are not delivered and the operator must know how many.
            log.warning("sender %s closed with %d unacked group(s)", self.actor_id, left)

    def _close_on_exit(self, failed: bool) -> None:
        # On an exception, do not wait for acks that may never come.
        self.close(timeout_s=0.0 if failed else 5.0)

    # ------------------------------------------------------------------ public API

    def submit(self, group: TrajectoryGroup, timeout_s: float | None = None) -> int:
        """Queue ``group`` for delivery and return its seq (also written into ``group``).

        Blocks while the outbox holds ``outbox_max`` unacked groups; raises TimeoutError if no
        space frees within ``timeout_s`` (None: wait forever), ProtocolError if the group is
        malformed (no seq is consumed then), RuntimeError after close or an I/O thread failure.
        """
        if group.actor_id not in ("", self.actor_id):
            raise ValueError(f"group.actor_id {group.actor_id!r} != sender {self.actor_id!r}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        lock_timeout_s = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
        full = f"submit: outbox full ({self._outbox_max}) for {timeout_s} s"
        if not self._submit_lock.acquire(timeout=lock_timeout_s):
            raise TimeoutError(full)
        try:
            with self._cond:
                waited_from = time.monotonic()
                try:
                    while True:
                        self._check_usable()
                        if len(self._outbox) < self._outbox_max:
                            break
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            raise TimeoutError(full)
                        self._cond.wait(remaining)
                finally:
                    self._blocked_s += time.monotonic() - waited_from
                seq = self._next_seq
            # Encode outside _cond so the I/O thread keeps handling acks meanwhile.
            # With limits: the receiver's own validation, in the same pass as the encoding.
            frame = encode(
                dataclasses.replace(group, actor_id=self.actor_id, seq=seq), self._limits
            )
            if len(frame) > self._max_frame_bytes:
                # The learner's MAXMSGSIZE would drop the connection on it, we would reconnect
                # and resend it, forever: refuse it here instead.
                raise ProtocolError("oversize", f"{len(frame)} > {self._max_frame_bytes} bytes")
            if self._spool is not None:
                self._spool.put(seq, frame)  # on disk before it can be sent (and acked)
            with self._cond:
                self._enqueue(seq, frame)
            group.actor_id = self.actor_id
            group.seq = seq
        finally:
            self._submit_lock.release()
        self._ring()
        return seq

    def set_status(self, version: int, stats: dict[str, float]) -> None:
        """What the next heartbeats carry: the actor's current policy version and its numbers."""
        # Validate here: an unencodable heartbeat would otherwise fail inside the I/O thread.
        encode(Heartbeat(actor_id=self.actor_id, version=version, stats=stats, sent_at=0.0))
        with self._cond:
            self._status_version = version
            self._status_stats = dict(stats)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted group is acked; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._outbox:
                self._raise_if_failed()
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._thread is None or self._closed:
                    return False
                self._cond.wait(remaining)
            return True

    def unacked(self) -> int:
        with self._cond:
            return len(self._outbox)

    def unacked_seqs(self) -> list[int]:
        """Seqs still waiting for an ack, oldest first (for ledgers and shutdown reports)."""
        with self._cond:
            return list(self._outbox)

    acked_total = guarded("_acked_total", "Groups acked by the learner.")
    resent_total = guarded("_resent_total", "Sends of a group after its first.")

    def stats(self) -> dict[str, float]:
        with self._cond:
            return {
                mn.SENDER_UNACKED: float(len(self._outbox)),
                # Waiting for a send (new, or due again after a reconnect/timeout).
                mn.SENDER_UNSENT: float(sum(e.last_sent is None for e in self._outbox.values())),
                mn.SENDER_ACKED_TOTAL: float(self._acked_total),
                mn.SENDER_REFUSED_TOTAL: float(sum(self._refused.values())),
                **{f"{mn.SENDER_REFUSED_PREFIX}{r}": float(n) for r, n in self._refused.items()},
                mn.SENDER_RESENT_TOTAL: float(self._resent_total),
                mn.SENDER_CONNECTS: float(self._connects),
                mn.SENDER_RECONNECTS: float(self._reconnects),
                mn.SENDER_BAD_REPLIES: float(self._bad_replies),
                mn.SENDER_SUBMIT_BLOCKED_S: self._blocked_s,
            }

    # ------------------------------------------------------------------ caller-side helpers

    def _enqueue(self, seq: int, frame: bytes) -> None:
        """Under ``_cond``: a new frame in the outbox, due for its first send."""
        self._outbox[seq] = _Entry(frame)
        self._unsent.append(seq)
        self._next_seq = max(self._next_seq, seq + 1)

    def _requeue_sent(self, older_than: float | None = None) -> None:
        """Under ``_cond``: queue again every sent entry (last sent before ``older_than``)."""
        for seq, entry in self._outbox.items():
            sent = entry.last_sent
            if sent is not None and (older_than is None or sent <= older_than):
                entry.last_sent = None
                self._unsent.append(seq)

    def _check_usable(self) -> None:
        self._raise_if_failed()
        if self._closed:
            raise RuntimeError("sender is closed")

    def _ring(self) -> None:
        with self._doorbell_lock:
            if self._doorbell_tx is None:
                return
            # zmq.Again: the doorbell pipe is full, so a wake-up is already pending.
            with contextlib.suppress(zmq.Again):
                self._doorbell_tx.send(b"", zmq.NOBLOCK)

    # ------------------------------------------------------------------ I/O thread

    def _loop(self, sock: zmq.Socket, monitor: zmq.Socket, doorbell_rx: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(doorbell_rx, zmq.POLLIN)
        next_heartbeat = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_heartbeat and self._send_heartbeat(sock):
                next_heartbeat = now + self._heartbeat_interval_s
            blocked = not self._send_due(sock, now)
            wait_s = min(next_heartbeat, self._next_scan) - time.monotonic()
            if blocked or now >= next_heartbeat:
                wait_s = min(wait_s, _BLOCKED_RETRY_S)
            wait_s = min(max(wait_s, 0.0), _MAX_POLL_S)
            events = dict(poller.poll(int(wait_s * 1000) + 1 if wait_s > 0 else 0))  # ms
            if doorbell_rx in events:
                for _ in ready(doorbell_rx.recv):
                    pass  # wake-ups only: the outbox says what to send
            if monitor in events and self._on_monitor(monitor):
                next_heartbeat = time.monotonic()  # tell a (new) learner about us at once
            if sock in events:
                self._on_replies(sock)

    def _send_due(self, sock: zmq.Socket, now: float) -> bool:
        """Send queued groups (new, reconnect or timed out), oldest first; False if zmq refused
        one (retry later). Timed-out groups are queued by a scan every ``_scan_interval_s``,
        so a wake-up costs O(groups sent), not O(outbox)."""
        if now >= self._next_scan:
            self._next_scan = now + self._scan_interval_s
            with self._cond:
                self._requeue_sent(older_than=now - self._resend_timeout_s)
        while True:
            with self._cond:
                if not self._unsent:
                    return True
                seq = self._unsent[0]
                entry = self._outbox.get(seq)
                if entry is None:  # acked meanwhile
                    self._unsent.popleft()
                    continue
            try:
                sock.send(entry.frame, zmq.NOBLOCK)
            except zmq.Again:
                return False
            with self._cond:
                self._unsent.popleft()
                # Only this thread removes queued seqs; stay correct if an ack raced ahead.
                if seq in self._outbox:
                    if entry.sends:
                        self._resent_total += 1
                    entry.sends += 1
                    entry.last_sent = time.monotonic()

    def _send_heartbeat(self, sock: zmq.Socket) -> bool:
        with self._cond:
            beat = Heartbeat(
                actor_id=self.actor_id,
                version=self._status_version,
                stats=dict(self._status_stats),
                sent_at=time.time(),
            )
        try:
            sock.send(encode(beat), zmq.NOBLOCK)
        except zmq.Again:
            return False  # not connected (or pipe full): retried shortly, heartbeats are cheap
        return True

    def _on_monitor(self, monitor: zmq.Socket) -> bool:
        """Handle socket events; True if a connection (re)completed its handshake."""
        connected = False
        for message in ready(lambda flags: recv_monitor_message(monitor, flags)):
            event = message["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._link_lost = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                connected = True
        if connected:
            with self._cond:
                self._connects += 1
                # Keyed on a seen disconnect, not on "not the first handshake": the monitor is
                # attached after connect() and may miss the first handshake. IMMEDIATE refuses
                # sends before any handshake, so nothing can be lost without a disconnect.
                if self._link_lost:
                    self._link_lost = False
                    self._reconnects += 1
                    # Anything sent before now may have died with the old connection (some of
                    # it may arrive twice now; the learner drops those duplicates).
                    self._requeue_sent()
        return connected

    def _on_replies(self, sock: zmq.Socket) -> None:
        for frame in ready(sock.recv):
            try:
                msg = decode(frame, _ACK_LIMITS)
            except ProtocolError as e:
                # I/O boundary: a bad reply must not stop delivery; the group stays unacked.
                self._count_bad_reply(f"undecodable reply ({e.reason})")
                continue
            if not isinstance(msg, Ack) or msg.actor_id != self.actor_id:
                self._count_bad_reply(f"unexpected {type(msg).__name__} for {msg.actor_id!r}")
                continue
            with self._cond:
                acked = [seq for seq in msg.seqs if self._outbox.pop(seq, None) is not None]
                self._acked_total += len(acked)
                refused = {
                    reason: [seq for seq in seqs if self._outbox.pop(seq, None) is not None]
                    for reason, seqs in msg.refused.items()
                }
                for reason, seqs in refused.items():
                    self._refused[reason] = self._refused.get(reason, 0) + len(seqs)
                self._cond.notify_all()
            for reason, seqs in refused.items():
                if seqs:
                    log.error(
                        "sender %s: the learner refused %d group(s) (%s), seqs %s; dropped",
                        self.actor_id,
                        len(seqs),
                        reason,
                        seqs[:8],
                    )
            if self._spool is not None:
                for seq in [*acked, *(s for seqs in refused.values() for s in seqs)]:
                    self._spool.remove(seq)

    def _count_bad_reply(self, what: str) -> None:
        with self._cond:
            self._bad_replies += 1
            n = self._bad_replies
        # Powers of two: visible at first, quiet if a peer keeps sending garbage.
        if n & (n - 1) == 0:
            log.warning("sender %s: %s (%d bad replies so far)", self.actor_id, what, n)

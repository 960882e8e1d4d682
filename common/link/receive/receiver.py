"""The learner's end of the delivery contract (docs/design.md §5.2): the ROUTER socket, its I/O
thread, the frames it decodes and the acks it sends. What each group does to the queue, dedupe
record and log is common/link/receive/intake.py: the receiver holds an ``Intake``, hands it each
decoded message and answers the learner's reads from it.

Authentication: with ``curve`` the link is CurveZMQ; with ``authorized_keys`` too, a ZAP handler
admits only clients whose public key is a ``*.key`` certificate in that directory (re-read when
the directory changes, so revoking a key is deleting its file). Every refused handshake is
counted as ``receiver/unauthenticated`` and logged.

Size: the socket reads frames up to ``DecodeLimits.socket_bytes`` (``learner.max_frame_bytes``),
so a frame over the decode bound but within it is read and counted as an ``oversize`` bad frame
(its length is checked before its bytes are copied out of libzmq); libzmq closes a connection
that announces a larger frame without reading it, and every closed connection is counted
(``receiver/disconnects``), as the frame itself never reaches the learner.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from common.curve_keys import CurveKeys
from common.link.protocol import Ack, DecodeLimits, Heartbeat, ProtocolError, decode, encode
from common.link.receive.admission import Admission
from common.link.receive.intake import LOG_EVERY_S, Intake, PendingAck
from common.link.receive.wal import WalWriter
from common.link.transport import (
    DEFAULT_HWM,
    DEFAULT_MAX_FRAME_BYTES,
    SocketThread,
    make_socket,
    ready,
    shared_context,
)

log = logging.getLogger(__name__)

# Handshakes a CURVE server refuses: ZAP said no (key not listed), the CURVE exchange failed (the
# client does not know the learner's public key), or the client speaks another mechanism.
_REFUSED_EVENTS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key not authorized",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "CURVE handshake failed (wrong learner key or no CURVE)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
}
# A connection ended: the peer closed it or vanished, or libzmq closed it (a frame larger than
# the socket's MAXMSGSIZE, a ZMTP error); the monitor cannot tell which.
_DISCONNECTED = zmq.EVENT_DISCONNECTED
# Acks are ~60-byte frames, at most one per actor per batch; a ROUTER drops replies beyond its
# send HWM (and each dropped ack costs the actor a resend timeout), so give them room.
_ACK_HWM = 4096
_POLL_S = 0.05  # bounds how long close() waits for the I/O thread
_MAX_BATCH = 256  # frames handled per wake-up before re-checking stop/backpressure


def bind_router(
    address: str,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    hwm: int = DEFAULT_HWM,
    curve_secret_key: bytes | None = None,
    curve_public_key: bytes | None = None,
    context: zmq.Context | None = None,
    sndhwm: int | None = None,
) -> zmq.Socket:
    """A ROUTER bound to ``address`` (``tcp://host:*`` picks a free port; see bound_endpoint).

    ``sndhwm`` (default ``hwm``): messages queued towards one peer; a ROUTER *drops* what exceeds
    it, so one that acks every message needs more room than the inbound ``hwm``.

    ROUTER_MANDATORY stays off: a reply to a peer that has gone is dropped, not an error; the
    peer resends whatever it did not see acked. ROUTER_HANDOVER is on so a restarted actor
    reusing its identity takes over at once instead of being refused until the old, dead
    connection times out.
    """
    if (curve_secret_key is None) != (curve_public_key is None):
        raise ValueError("CURVE server needs both curve_secret_key and curve_public_key")
    options: dict[int, int | bytes] = {
        zmq.SNDHWM: hwm if sndhwm is None else sndhwm,
        zmq.ROUTER_MANDATORY: 0,
        zmq.ROUTER_HANDOVER: 1,
    }
    curve: dict[int, int | bytes] = {}
    if curve_secret_key is not None and curve_public_key is not None:
        curve = {
            zmq.CURVE_SERVER: 1,
            zmq.CURVE_SECRETKEY: curve_secret_key,
            zmq.CURVE_PUBLICKEY: curve_public_key,
        }
    return make_socket(zmq.ROUTER, address, options, curve, context, max_frame_bytes, hwm)


def bound_endpoint(sock: zmq.Socket) -> str:
    """The concrete endpoint a socket last bound, e.g. ``tcp://127.0.0.1:41234``."""
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


class GroupReceiver(SocketThread):
    """Receives TrajectoryGroups and heartbeats on a ROUTER; ``get()`` yields each group once.

    The ROUTER belongs to this end's I/O thread (:class:`SocketThread`); the groups, the dedupe
    record, the log and the counters belong to its :class:`Intake` (``intake``), which holds the
    lock they need: the learner reads groups and figures from the intake, beside the receiver
    that fills it."""

    def __init__(
        self,
        bind_address: str,
        limits: DecodeLimits,
        *,
        context: zmq.Context | None = None,
        actor_timeout_s: float = 30.0,
        queue_max: int = 1024,
        hwm: int = DEFAULT_HWM,
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
        if authorized_keys is not None and curve is None:
            raise ValueError("authorized_keys needs curve (the allow-list is of CURVE keys)")
        if authorized_keys is not None and not Path(authorized_keys).is_dir():
            raise FileNotFoundError(f"authorized_keys directory {authorized_keys} does not exist")
        self.intake = Intake(actor_timeout_s, queue_max, wal, admission, latest_version)
        """What was received: the groups (``get``, ``drain``), the dedupe record, the log and
        the counters (``stats``)."""
        super().__init__("receiver", "group-receiver")
        self._bind_address = bind_address
        self._limits = limits
        self._hwm = hwm
        self._curve = curve
        self._allow_list = _AllowList(Path(authorized_keys)) if authorized_keys else None
        # ZAP handlers are per context: a receiver with an allow-list gets a context of its own.
        self._own_context = self._allow_list is not None and context is None
        self._context = zmq.Context() if self._own_context else (context or shared_context())
        self._authenticator: ThreadAuthenticator | None = None
        self._bound_address: str | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> GroupReceiver:
        self._require_not_started()
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
            max_frame_bytes=self._limits.socket_bytes,
            hwm=self._hwm,
            sndhwm=_ACK_HWM,
            context=self._context,
            curve_secret_key=self._curve.secret if self._curve else None,
            curve_public_key=self._curve.public if self._curve else None,
        )
        self._bound_address = bound_endpoint(sock)
        events = _DISCONNECTED
        if self._curve is not None:
            events |= functools.reduce(operator.or_, _REFUSED_EVENTS)
        self.intake.mark_started()
        self._spawn(sock, sock.get_monitor_socket(events))
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
        self.intake.close()

    @property
    def bound_address(self) -> str:
        """The concrete endpoint (a ``:*`` / port-0 bind resolved), valid after ``start()``."""
        if self._bound_address is None:
            raise RuntimeError("GroupReceiver not started")
        return self._bound_address

    # ------------------------------------------------------------------ I/O thread

    def _loop(self, sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
        try:
            self._serve(sock, monitor)
        except BaseException as e:
            self.intake.fail(e)  # the learner's get() raises it from now on
            raise  # SocketThread logs it and closes the sockets

    def _release(self) -> None:
        self.intake.close_log()

    def _serve(self, sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        while not self._stop.is_set():
            if self.intake.queue_full():
                # Backpressure: read nothing (so ack nothing) until get() frees space.
                if monitor is not None:
                    self._drain_monitor(monitor)
                self.intake.wait_for_space(_POLL_S)
                continue
            events = dict(poller.poll(int(_POLL_S * 1000)))
            if monitor is not None and monitor in events:
                self._drain_monitor(monitor)
            if sock not in events:
                continue
            acks: dict[bytes, PendingAck] = {}
            # copy=False: a frame's length is checked before its bytes are copied out of libzmq.
            receive = functools.partial(sock.recv_multipart, copy=False)
            for parts in itertools.islice(ready(receive), _MAX_BATCH):
                if self._handle(parts, acks):
                    break
            if acks:
                self.intake.batch_done()
            self._send_acks(sock, acks)

    def _send_acks(self, sock: zmq.Socket, acks: dict[bytes, PendingAck]) -> None:
        """One Ack per actor for the whole batch, after the log has the batch (group commit)."""
        if not acks:
            return
        self.intake.flush_log()
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
        self.intake.count_acks_sent(sum(len(p.seqs) for p in acks.values()))

    def _handle(self, parts: list[zmq.Frame], acks: dict[bytes, PendingAck]) -> bool:
        """Process one ROUTER message, adding any ack it earns to ``acks``; True if the queue
        is now full (stop reading)."""
        intake = self.intake
        identity = parts[0].bytes
        if identity.startswith(b"\x00"):
            # libzmq renames a connection that a reconnecting peer took its identity from
            # (ROUTER_HANDOVER) to a NUL-led id; frames still buffered on that old connection
            # arrive under it. Actors cannot choose such ids, an ack could not reach them, and
            # the actor resends them on its new connection: drop them, counted apart.
            intake.count_handover_dropped()
            return False
        if len(parts) != 2:
            intake.reject(identity, "bad_envelope", f"{len(parts) - 1} frames")
            return False
        size, bound = len(parts[1]), self._limits.max_frame_bytes
        if size > bound:
            # Read (it is within the socket's bound) only to be counted: never copied or decoded.
            intake.reject(identity, "oversize", f"{size} > {bound} bytes")
            return False
        frame = parts[1].bytes
        try:
            msg = decode(frame, self._limits)
        except ProtocolError as e:
            # I/O boundary: count, log, keep serving; the sender resends anything unacked.
            intake.reject(identity, e.reason, e.detail)
            return False
        if isinstance(msg, Ack):
            intake.reject(identity, "wrong_direction", "Ack sent to the learner")
            return False
        if msg.actor_id.encode("utf-8") != identity:
            intake.reject(identity, "identity_mismatch", f"frame says {msg.actor_id!r}")
            return False
        if isinstance(msg, Heartbeat):
            intake.on_heartbeat(msg)
            return False
        return intake.on_group(msg, frame, acks.setdefault(identity, PendingAck()))

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        for event in ready(lambda flags: recv_monitor_message(monitor, flags)):
            if event["event"] == _DISCONNECTED:
                self.intake.count_disconnect()
                continue
            reason = _REFUSED_EVENTS.get(event["event"])
            if reason is None:
                continue
            self.intake.count_unauthenticated()
            self.intake.log_limited(
                "unauthenticated",
                "refused a connection to %s: %s",
                event.get("endpoint", b"?"),
                reason,
            )


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
            quiet = now - self._logged_at.get(key, -LOG_EVERY_S) < LOG_EVERY_S
            if not allowed and not quiet:
                self._logged_at[key] = now
        if not allowed and not quiet:
            log.warning("refused CURVE client key %s: not in %s", key.decode(), self.directory)
        return allowed

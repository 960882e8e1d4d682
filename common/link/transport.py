"""ZeroMQ sockets for the actor -> learner link (docs/design.md §5.2).

Every zmq option both ends rely on is set in ``make_socket``, so the sender and the receiver
(its ROUTER: common/link/receive/receiver.py) only deal in frames. ``curve_*`` arguments (z85 keys, as made
by ``zmq.curve_keypair()``) switch a socket to CURVE encryption + server authentication.

:class:`SocketThread` is the I/O thread both ends run: it owns the sockets (zmq sockets are not
thread-safe), hands a failure to the owner's callers, and closes the sockets when it ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Self, TypeVar

import zmq

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
# Messages, not bytes: with ~100 KB groups this bounds each direction of each link to a few MB,
# which is what turns a slow learner into backpressure instead of memory growth.
DEFAULT_HWM = 64
# A peer silent (no data, no ZMTP ping) for the timeout is dropped, so a dead TCP link (cable
# pulled, host gone, no FIN) is noticed in seconds and the DEALER reconnects.
DEFAULT_HEARTBEAT_IVL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0


def shared_context() -> zmq.Context:
    """The process-wide context; its I/O threads serve every socket made here."""
    return zmq.Context.instance()


def _ms(seconds: float) -> int:
    return max(0, int(round(seconds * 1000)))


def make_socket(
    kind: int,
    address: str,
    options: dict[int, int | bytes],
    curve: dict[int, int | bytes],
    context: zmq.Context | None,
    max_frame_bytes: int,
    hwm: int,
) -> zmq.Socket:
    """A socket of ``kind`` with the options every link uses, then its own ``options`` and, if
    any, the ``curve`` ones; bound to ``address`` (a ROUTER) or connected to it (a DEALER).
    Closed again if any of it fails."""
    sock = (context or shared_context()).socket(kind)
    try:
        common = {
            # Closing must not hang the process on unsent frames: delivery is guaranteed by the
            # outbox + acks, not by zmq's buffers.
            zmq.LINGER: 0,
            zmq.SNDHWM: hwm,
            zmq.RCVHWM: hwm,
            # libzmq drops a connection whose peer announces a larger message, before
            # allocating it.
            zmq.MAXMSGSIZE: max_frame_bytes,
            zmq.HEARTBEAT_IVL: _ms(DEFAULT_HEARTBEAT_IVL_S),
            zmq.HEARTBEAT_TIMEOUT: _ms(DEFAULT_HEARTBEAT_TIMEOUT_S),
            # TTL tells the peer to drop us too if our pings stop arriving.
            zmq.HEARTBEAT_TTL: _ms(DEFAULT_HEARTBEAT_TIMEOUT_S),
            zmq.TCP_KEEPALIVE: 1,
        }
        if curve and not zmq.has("curve"):
            raise RuntimeError("this libzmq build has no CURVE support")
        for option, value in {**common, **options, **curve}.items():
            sock.setsockopt(option, value)
        if kind == zmq.ROUTER:
            sock.bind(address)
        else:
            sock.connect(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def connect_dealer(
    address: str,
    identity: bytes,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    hwm: int = DEFAULT_HWM,
    reconnect_ivl_s: float = 0.1,
    reconnect_ivl_max_s: float = 2.0,
    curve_secret_key: bytes | None = None,
    curve_public_key: bytes | None = None,
    curve_server_key: bytes | None = None,
    context: zmq.Context | None = None,
) -> zmq.Socket:
    """A DEALER connected to ``address`` whose ROUTER-side identity is ``identity``.

    IMMEDIATE is on: while no connection is up, a non-blocking send fails with ``zmq.Again``
    instead of queueing into a pipe that a dead link would discard, so the caller's outbox
    stays the single record of what is unsent.
    """
    if not 1 <= len(identity) <= 255 or identity.startswith(b"\x00"):
        raise ValueError(f"zmq identity must be 1..255 bytes not starting with NUL: {identity!r}")
    keys = (curve_secret_key, curve_public_key, curve_server_key)
    if any(k is not None for k in keys) and not all(k is not None for k in keys):
        raise ValueError("CURVE client needs curve_secret_key, curve_public_key, curve_server_key")
    options: dict[int, int | bytes] = {
        zmq.IDENTITY: identity,
        zmq.IMMEDIATE: 1,
        zmq.RECONNECT_IVL: _ms(reconnect_ivl_s),
        zmq.RECONNECT_IVL_MAX: _ms(reconnect_ivl_max_s),
    }
    curve: dict[int, int | bytes] = {}
    if curve_server_key is not None:
        curve = {
            zmq.CURVE_SECRETKEY: curve_secret_key,
            zmq.CURVE_PUBLICKEY: curve_public_key,
            zmq.CURVE_SERVERKEY: curve_server_key,
        }
    return make_socket(zmq.DEALER, address, options, curve, context, max_frame_bytes, hwm)


def ready(recv: Callable[[int], T]) -> Iterator[T]:
    """What ``recv`` returns for each message already waiting: it is called with
    ``zmq.NOBLOCK`` until ``zmq.Again``."""
    while True:
        try:
            yield recv(zmq.NOBLOCK)
        except zmq.Again:
            return


def guarded(attr: str, doc: str | None = None) -> property:
    """A read-only property returning ``self.<attr>`` under ``self._cond``, the condition that
    guards its owner's shared state (a :class:`SocketThread`'s, or the receiver's ``Intake``)."""

    def get(self: Any) -> object:
        with self._cond:
            return getattr(self, attr)

    return property(get, doc=doc)


class SocketThread:
    """One end of the link whose sockets belong to a single background I/O thread (zmq sockets
    are not thread-safe); callers talk to it through state guarded by ``_cond``.

    A subclass builds its sockets in ``start`` (so a bind or connect error raises in the caller)
    and hands them to ``_spawn``; it implements ``_loop(sock, monitor, *others)``, which runs
    until ``_stop`` is set, and ``close``. If ``_loop`` raises, the failure is kept in ``_error``
    and ``_cond`` notified, for the callers to raise (``_raise_if_failed``); when the thread
    ends, its sockets are closed.
    """

    def __init__(self, role: str, thread_name: str) -> None:
        """``role`` names this end in errors (``"receiver"``: "receiver I/O thread failed")."""
        self._role = role
        self._thread_name = thread_name
        # Guards the subclass's shared state; notified when the I/O thread fails.
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Self:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _close_on_exit(self, failed: bool) -> None:
        """``with`` exit: ``failed`` when an exception is leaving the block."""
        self.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close_on_exit(exc_type is not None)

    def _require_not_started(self, what: str = "") -> None:
        """Raise if the I/O thread was started: ``what`` must be called before ``start()``
        (without ``what``: ``start`` itself, called a second time)."""
        if self._thread is None:
            return
        if what:
            raise RuntimeError(f"{what} must be called before start()")
        raise RuntimeError(f"{type(self).__name__} already started")

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"{self._role} I/O thread failed") from self._error

    def _spawn(self, sock: zmq.Socket, monitor: zmq.Socket | None, *others: zmq.Socket) -> None:
        """Start the I/O thread, which owns ``sock``, its ``monitor`` and ``others`` from now."""
        self._thread = threading.Thread(
            target=self._run, args=(sock, monitor, others), name=self._thread_name, daemon=True
        )
        self._thread.start()

    def _loop(self, sock: zmq.Socket, monitor: zmq.Socket | None, *others: zmq.Socket) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        """What the I/O thread lets go of besides its sockets when it ends."""

    def _run(
        self, sock: zmq.Socket, monitor: zmq.Socket | None, others: tuple[zmq.Socket, ...]
    ) -> None:
        try:
            self._loop(sock, monitor, *others)
        except BaseException as e:
            # Thread boundary: hand the failure to the callers.
            log.exception("%s I/O thread failed", self._thread_name)
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            for other in others:
                other.close(linger=0)
            self._release()
            sock.close()

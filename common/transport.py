"""ZeroMQ socket construction for the actor -> learner link (docs/design.md §5.2).

Every zmq option the project relies on is set here, once, so the sender and the receiver only
deal in frames. Sockets are returned unconnected to any thread: the caller's I/O thread owns
each socket for its whole life (zmq sockets are not thread-safe).

CurveZMQ: ``curve_*`` keyword arguments (z85-encoded keys, as made by ``zmq.curve_keypair()``)
switch a socket to CURVE encryption + server authentication. Client allow-listing (a ZAP
authenticator) is not set up here yet.
"""

from __future__ import annotations

import zmq

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


def _apply_common(
    sock: zmq.Socket,
    *,
    max_frame_bytes: int,
    hwm: int,
    heartbeat_ivl_s: float,
    heartbeat_timeout_s: float,
    linger_s: float,
) -> None:
    # Closing must not hang the process on unsent frames: delivery is guaranteed by the
    # outbox + acks, not by zmq's buffers.
    sock.setsockopt(zmq.LINGER, _ms(linger_s))
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    # libzmq drops a connection whose peer announces a larger message, before allocating it.
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.HEARTBEAT_IVL, _ms(heartbeat_ivl_s))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(heartbeat_timeout_s))
    # TTL tells the peer to drop us too if our pings stop arriving.
    sock.setsockopt(zmq.HEARTBEAT_TTL, _ms(heartbeat_timeout_s))
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)


def connect_dealer(
    address: str,
    identity: bytes,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    hwm: int = DEFAULT_HWM,
    heartbeat_ivl_s: float = DEFAULT_HEARTBEAT_IVL_S,
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    reconnect_ivl_s: float = 0.1,
    reconnect_ivl_max_s: float = 2.0,
    linger_s: float = 0.0,
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
    curve = (curve_secret_key, curve_public_key, curve_server_key)
    if any(k is not None for k in curve) and not all(k is not None for k in curve):
        raise ValueError("CURVE client needs curve_secret_key, curve_public_key, curve_server_key")
    sock = (context or shared_context()).socket(zmq.DEALER)
    try:
        _apply_common(
            sock,
            max_frame_bytes=max_frame_bytes,
            hwm=hwm,
            heartbeat_ivl_s=heartbeat_ivl_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            linger_s=linger_s,
        )
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, _ms(reconnect_ivl_s))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, _ms(reconnect_ivl_max_s))
        if curve_server_key is not None:
            _require_curve()
            sock.curve_secretkey = curve_secret_key
            sock.curve_publickey = curve_public_key
            sock.curve_serverkey = curve_server_key
        sock.connect(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def bind_router(
    address: str,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    hwm: int = DEFAULT_HWM,
    heartbeat_ivl_s: float = DEFAULT_HEARTBEAT_IVL_S,
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    linger_s: float = 0.0,
    curve_secret_key: bytes | None = None,
    curve_public_key: bytes | None = None,
    context: zmq.Context | None = None,
    sndhwm: int | None = None,
) -> zmq.Socket:
    """A ROUTER bound to ``address`` (``tcp://host:*`` picks a free port; see bound_endpoint).

    ``sndhwm`` (default ``hwm``): messages queued towards one peer. A ROUTER *drops* what exceeds
    it, so the replies of a ROUTER that answers every message (acks) need more room than the
    requests' ``hwm``, which is what bounds the inbound side.

    ROUTER_MANDATORY stays off: a reply to a peer that has gone is dropped, not an error; the
    peer resends whatever it did not see acked. ROUTER_HANDOVER is on so a restarted actor
    reusing its identity takes over at once instead of being refused until the old, dead
    connection times out.
    """
    if (curve_secret_key is None) != (curve_public_key is None):
        raise ValueError("CURVE server needs both curve_secret_key and curve_public_key")
    sock = (context or shared_context()).socket(zmq.ROUTER)
    try:
        _apply_common(
            sock,
            max_frame_bytes=max_frame_bytes,
            hwm=hwm,
            heartbeat_ivl_s=heartbeat_ivl_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            linger_s=linger_s,
        )
        if sndhwm is not None:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if curve_secret_key is not None:
            _require_curve()
            sock.curve_server = True
            sock.curve_secretkey = curve_secret_key
            sock.curve_publickey = curve_public_key
        sock.bind(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def bound_endpoint(sock: zmq.Socket) -> str:
    """The concrete endpoint a socket last bound, e.g. ``tcp://127.0.0.1:41234``."""
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq build has no CURVE support")

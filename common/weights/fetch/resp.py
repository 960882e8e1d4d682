"""GETs streamed over a raw Redis socket: RESP2/3 replies read by hand, each bulk value landing
straight in the caller's memory (the kernel's copy is the only one), a few requests in flight
so Redis builds the next reply while this one is received and never holds a whole model in one
client's output buffer."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import redis
import redis.connection

# GETs in flight while streaming.
_FETCH_WINDOW = 2
# Longest RESP status line we accept (``$<length>``, ``-ERR ...``) before calling it garbage.
_MAX_RESP_LINE = 64 * 1024

_RAW_CONNECTION_CLASSES = (
    redis.connection.Connection,
    redis.connection.SSLConnection,
    redis.connection.UnixDomainSocketConnection,
)


def raw_connection(client: redis.Redis) -> redis.connection.AbstractConnection | None:
    """A fresh connection of ``client``'s kind whose socket we may read directly, or None where
    that is not a plain socket (client-side caching, sentinel, cluster...)."""
    pool = client.connection_pool
    kwargs = getattr(pool, "connection_kwargs", None)
    if (
        getattr(pool, "connection_class", None) not in _RAW_CONNECTION_CLASSES
        or kwargs is None
        or getattr(pool, "cache", None) is not None
    ):
        return None
    conn = pool.connection_class(**kwargs)
    conn.connect()  # connect, AUTH, SELECT: all replies read before we touch the socket
    if not isinstance(getattr(conn, "_sock", None), socket.socket):
        conn.disconnect()
        return None
    return conn


class _RespReader:
    """RESP2/3 replies read off a raw socket: status lines through a small buffer, bulk payloads
    straight into the caller's memory."""

    _RECV_BYTES = 4096

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()

    def _fill(self) -> None:
        data = self._sock.recv(self._RECV_BYTES)
        if not data:
            raise ConnectionError("Redis closed the connection in the middle of a reply")
        self._buf += data

    def readline(self) -> bytes:
        searched = 0
        while (end := self._buf.find(b"\r\n", searched)) < 0:
            if len(self._buf) > _MAX_RESP_LINE:
                raise redis.exceptions.InvalidResponse(f"no line end in {len(self._buf)} bytes")
            searched = max(0, len(self._buf) - 1)
            self._fill()
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

    def read_into(self, out: memoryview) -> None:
        take = min(len(out), len(self._buf))
        out[:take] = self._buf[:take]
        del self._buf[:take]
        while take < len(out):
            got = self._sock.recv_into(out[take:])
            if not got:
                raise ConnectionError("Redis closed the connection in the middle of a reply")
            take += got

    def skip_value(self, line: bytes) -> None:
        """Consume the rest of the RESP2/3 value whose first line is ``line``."""
        kind, count = line[:1], line[1:]
        if kind in b"$=!":  # bulk string, verbatim string, blob error ($-1: null)
            size = int(count)
            if size >= 0:
                while len(self._buf) < size + 2:
                    self._fill()
                del self._buf[: size + 2]
        elif kind in b"*>~%|":  # array, push, set (*-1: null); map and attribute: pairs
            items = int(count) * (2 if kind in b"%|" else 1)
            for _ in range(max(0, items)):
                self.skip_value(self.readline())

    def skip_crlf(self) -> None:
        while len(self._buf) < 2:
            self._fill()
        if self._buf[:2] != b"\r\n":
            raise redis.exceptions.InvalidResponse("bulk reply not followed by CRLF")
        del self._buf[:2]

    def bulk_header(self) -> int | None:
        """The length of the next reply, a bulk string; None for a null (no such key). Push
        messages and attributes before it are skipped; an error reply is raised."""
        line = self.readline()
        while line[:1] in b">|":  # RESP3 push message or attribute: not our reply
            self.skip_value(line)
            line = self.readline()
        if line[:1] in b"-!":
            if line[:1] == b"!":  # RESP3 blob error
                message = bytearray(int(line[1:]))
                self.read_into(memoryview(message))
                self.skip_crlf()
                line = b"-" + bytes(message)
            raise redis.ResponseError(line[1:].decode("utf-8", errors="replace"))
        if line == b"_":  # RESP3 null: no such key
            return None
        try:
            if line[:1] != b"$":
                raise ValueError(line[:1])
            size = int(line[1:])
        except ValueError as e:
            raise redis.exceptions.InvalidResponse(f"unexpected reply to GET: {line[:40]!r}") from e
        return size if size >= 0 else None  # RESP2 null ($-1): no such key


def stream_gets(
    conn: redis.connection.AbstractConnection,
    keys: list[str],
    out: memoryview,
    overflow: Callable[[], Exception],
) -> Iterator[memoryview | None]:
    """GET ``keys`` in order on ``conn``'s socket, ``_FETCH_WINDOW`` requests in flight, placing
    the values one after the other in ``out`` and yielding a view of where each landed; None for
    a missing key (and nothing after it). ``overflow()`` is raised when a value does not fit. The
    caller disconnects ``conn`` afterwards (replies may be left unread)."""
    sock: socket.socket = conn._sock  # type: ignore[attr-defined]
    reader = _RespReader(sock)
    requests = [b"".join(conn.pack_command("GET", key)) for key in keys]
    sent = 0
    pos = 0
    try:
        for i in range(len(keys)):
            ahead = min(len(keys), i + 1 + _FETCH_WINDOW)
            if ahead > sent:
                sock.sendall(b"".join(requests[sent:ahead]))
                sent = ahead
            size = reader.bulk_header()
            if size is None:
                yield None
                return
            if size > len(out) - pos:
                raise overflow()
            view = out[pos : pos + size]
            reader.read_into(view)
            reader.skip_crlf()
            pos += size
            yield view
    except TimeoutError as e:  # socket.timeout
        raise redis.TimeoutError(f"timeout reading weight chunks: {e}") from e
    except OSError as e:  # includes the ConnectionErrors raised above
        raise redis.ConnectionError(f"error reading weight chunks: {e}") from e

"""A reward worker process: ``python -m actors.rewards.worker SPEC [--sandbox MEMORY_MB]``.

It loads the reward function once, answers ``{"ready": true}`` (or the load error) and then, for
each request (a 4-byte big-endian length and a msgpack map of the reward arguments) on stdin,
writes one reply on the same framing: ``{"ok": true, "value": ...}`` or ``{"ok": false, "kind":
..., "error": ...}``. The function's own prints go to stderr, never into the replies. The parent
(:mod:`actors.rewards.pool`) enforces the time limit and checks every reply.

With ``--sandbox`` the worker first confines itself, before any user code is imported: a new
user and network namespace (no network interface but a down loopback), an address-space limit of
MEMORY_MB, a 64 MiB limit on files it writes, no core dumps. A worker that cannot confine itself
says so and exits; it never runs the function unconfined.
"""

from __future__ import annotations

import ctypes
import os
import resource
import struct
import sys
from typing import Any, BinaryIO

import msgpack

from actors.rewards.spec import REWARD_ARGUMENTS, load_reward_function

_HEADER = struct.Struct(">I")
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
FILE_SIZE_LIMIT = 64 << 20


def read_frame(stream: BinaryIO) -> Any:
    """The next msgpack frame of ``stream``, or None at its end."""
    header = _read_exactly(stream, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    payload = _read_exactly(stream, size)
    return None if payload is None else msgpack.unpackb(payload, raw=False)


def _read_exactly(stream: BinaryIO, size: int) -> bytes | None:
    """``size`` bytes of ``stream`` (a pipe may give them in pieces), or None at its end."""
    chunks, got = [], 0
    while got < size:
        chunk = stream.read(size - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def frame(message: Any, lenient: bool = False) -> bytes:
    """``message`` framed. numpy scalars go as Python numbers; any other type msgpack cannot
    carry is refused (TypeError), or with ``lenient`` (a data row's dates, decimals) sent as
    its ``str``."""
    payload = msgpack.packb(message, use_bin_type=True, default=_as_text if lenient else _plain)
    return _HEADER.pack(len(payload)) + payload


def _plain(value: Any) -> Any:
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"cannot send {type(value).__name__}")


def _as_text(value: Any) -> Any:
    try:
        return _plain(value)
    except TypeError:
        return str(value)


def confine(memory_mb: int) -> None:
    """Enter a new user and network namespace, then cap memory, file size and core dumps."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(
            errno,
            f"the reward sandbox cannot enter a network namespace (unshare: "
            f"{os.strerror(errno)}); unprivileged user namespaces are off on this host or in "
            "this container (sysctl kernel.unprivileged_userns_clone, Docker's seccomp profile)",
        )
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def serve(spec: str, replies: BinaryIO, requests: BinaryIO, memory_mb: int | None) -> int:
    try:
        if memory_mb is not None:
            confine(memory_mb)
        function = load_reward_function(spec)
    except Exception as err:  # noqa: BLE001 - any load error goes back to the parent, which stops the start
        replies.write(frame({"ready": False, "error": f"{type(err).__name__}: {err}"}))
        return 1
    replies.write(frame({"ready": True}))
    while (request := read_frame(requests)) is not None:
        try:
            value = function(**{k: request[k] for k in REWARD_ARGUMENTS})
        except Exception as err:  # noqa: BLE001 - the user's error is the reply
            reply = {"ok": False, "kind": "raised", "error": f"{type(err).__name__}: {err}"}
            replies.write(frame(reply))
            continue
        try:
            replies.write(frame({"ok": True, "value": value}))
        except (TypeError, ValueError, OverflowError) as err:
            replies.write(frame({"ok": False, "kind": "invalid", "error": f"returned {err}"}))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 3) or (len(argv) == 3 and argv[1] != "--sandbox"):
        print("usage: python -m actors.rewards.worker SPEC [--sandbox MEMORY_MB]", file=sys.stderr)
        return 2
    # The replies keep the real stdout; the function's prints go to stderr.
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    requests = os.fdopen(0, "rb", buffering=0)
    return serve(argv[0], replies, requests, int(argv[2]) if len(argv) == 3 else None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

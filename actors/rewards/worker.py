"""A reward worker process, started by :mod:`actors.rewards.pool` as
``python -I -u -c BOOT ROOT OPTIONS`` (:data:`BOOT`): isolated mode, so neither the working
directory nor any ``PYTHON*`` variable or user site directory reaches its path or start-up.

It loads the reward function once (a file's source from the copy the pool took at actor start,
passed as a sealed file descriptor, or a module), answers ``{"ready": true}`` (or the load error)
and then, for each request (a 4-byte big-endian length and a msgpack map of the reward arguments
and the call's ``id``) on stdin, writes one reply on the same framing: ``{"ok": true, "id": ...,
"value": ...}`` or ``{"ok": false, "id": ..., "kind": ..., "error": ...}``. The function's own
prints go to stderr, which the pool forwards to the actor's log, never into the replies.

Sandboxed (``limits`` in the options; the process already runs under bubblewrap,
:mod:`actors.rewards.sandbox`), it caps its address space, CPU time, file size, process count
and core dumps before the reward's code is read. Every worker asks for SIGKILL when its parent
dies. Code the reward function runs in its own process can still reach the reply channel: run
model-written code with :func:`actors.rewards.run_untrusted`, in a process of its own.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import struct
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

import msgpack

from actors.rewards.spec import REWARD_ARGUMENTS, load_reward_function, load_reward_source

BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from actors.rewards.worker import main; sys.exit(main(sys.argv[2]))"
)
"""The ``-c`` program that starts a worker: specrl's root first on the path, nothing else."""
_HEADER = struct.Struct(">I")
_PR_SET_PDEATHSIG = 1
_MAX_SOURCE_BYTES = 16 << 20


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


def die_with_parent(parent: int | None) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def limit(memory_mb: int, cpu_s: int, nproc: int, file_size: int) -> None:
    """Cap this process and what it starts: address space, CPU seconds, processes of its uid,
    file size, no core dumps."""
    for name, value in (
        (resource.RLIMIT_AS, memory_mb << 20),
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_NPROC, nproc),
        (resource.RLIMIT_FSIZE, file_size),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(name, (value, value))


def read_source(fd: int) -> bytes:
    """The reward file's copy behind ``fd`` (sealed by the pool), then ``fd`` closed."""
    try:
        size = os.fstat(fd).st_size
        if size > _MAX_SOURCE_BYTES:
            raise ValueError(f"the reward file is {size} bytes (at most {_MAX_SOURCE_BYTES})")
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def confine_and_read(options: dict[str, Any]) -> bytes | None:
    """A worker's start before it loads user code: the limits (sandboxed), the sealed copy of
    a ``.py`` file (if any) read, the user's paths put on ``sys.path``."""
    limits = options.get("limits")
    if limits:
        limit(**limits)
    source_fd = options.get("source_fd")
    source = read_source(source_fd) if source_fd is not None else None
    sys.path[1:1] = options.get("paths", [])
    return source


def load(options: dict[str, Any]) -> Any:
    """The reward function the options name, confined first when they carry limits."""
    source = confine_and_read(options)
    if source is not None:
        return load_reward_source(source, options["source_name"], options["spec"])
    return load_reward_function(options["spec"])


def hello(replies: BinaryIO, load_user_code: Callable[[], Any]) -> Any | None:
    """Load the user's code and tell the parent: ``ready``, or the error (then None, and the
    worker exits: the parent stops the start)."""
    try:
        loaded = load_user_code()
    except Exception as err:  # noqa: BLE001 - any load error goes back to the parent
        replies.write(frame({"ready": False, "error": f"{type(err).__name__}: {err}"}))
        return None
    replies.write(frame({"ready": True}))
    return loaded


def serve(options: dict[str, Any], replies: BinaryIO, requests: BinaryIO) -> int:
    function = hello(replies, lambda: load(options))
    if function is None:
        return 1
    while (request := read_frame(requests)) is not None:
        call_id = request.get("id")
        try:
            value = function(**{k: request[k] for k in REWARD_ARGUMENTS})
        except Exception as err:  # noqa: BLE001 - the user's error is the reply
            error = f"{type(err).__name__}: {err}"
            replies.write(frame({"ok": False, "id": call_id, "kind": "raised", "error": error}))
            continue
        try:
            replies.write(frame({"ok": True, "id": call_id, "value": value}))
        except (TypeError, ValueError, OverflowError) as err:
            reply = {"ok": False, "id": call_id, "kind": "invalid", "error": f"returned {err}"}
            replies.write(frame(reply))
    return 0


def main(options_json: str, serve_with: Callable[..., int] | None = None) -> int:
    """A worker's life: its options, death with its parent, then ``serve_with`` (default:
    :func:`serve`, the reward's) over the request and reply streams."""
    options = json.loads(options_json)
    die_with_parent(options.get("parent"))
    # The replies keep the real stdout (a descriptor no child inherits); the user code's prints
    # go to stderr.
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    requests = os.fdopen(0, "rb", buffering=0)
    return (serve_with or serve)(options, replies, requests)

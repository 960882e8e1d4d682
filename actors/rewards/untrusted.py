"""Run model-written code in a confined process of its own: :func:`run_untrusted`.

A reward that executes a completion (code RL) must not run it in its own process: code there
can write the worker's reply itself (a program that fails its tests would score 1.0), read the
reward's data row, or change the reward function. :func:`run_untrusted` runs it in a child under
bubblewrap (:mod:`actors.rewards.sandbox`): no file of the worker (the reply channel included),
its own pid namespace (a timeout kills every process it started), no network, a read-only
system, a private ``/tmp``, no ``/proc``, and limits on memory, CPU time, processes and file
size. Inside a sandboxed reward worker it nests a second sandbox.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from actors.rewards import sandbox as confinement

_LIMITS = """
import os, resource as r, sys
for key, value in zip((r.RLIMIT_AS, r.RLIMIT_CPU, r.RLIMIT_NPROC, r.RLIMIT_FSIZE), sys.argv[1:5]):
    hard = r.getrlimit(key)[1]  # inside a sandboxed worker: never above the worker's own
    value = int(value) if hard == r.RLIM_INFINITY else min(int(value), hard)
    r.setrlimit(key, (value, value))
r.setrlimit(r.RLIMIT_CORE, (0, 0))
os.execv(sys.argv[5], sys.argv[5:])
"""
"""The first program of the child: sets its limits, then becomes the untrusted program."""


@dataclass(frozen=True)
class UntrustedResult:
    """How the program ended: its exit code (negative: the signal), what it wrote (at most
    ``max_output_bytes`` of each stream) and whether it was killed at its time limit."""

    returncode: int
    stdout: bytes
    stderr: bytes
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def run_untrusted(
    code_or_argv: str | Sequence[str],
    *,
    timeout_s: float = 5.0,
    memory_bytes: int = 512 << 20,
    stdin: bytes | str = b"",
    max_output_bytes: int = 1 << 20,
    nproc: int = 16,
) -> UntrustedResult:
    """Run ``code_or_argv`` confined: Python source (a ``str``, run by this interpreter in
    isolated mode) or a program's argv, fed ``stdin``. It is killed, with everything it
    started, after ``timeout_s`` seconds; it gets ``memory_bytes`` of address space per
    process, ``nproc`` processes, files up to 64 MiB and ``/tmp`` as its working directory.
    Raises :class:`~actors.rewards.sandbox.SandboxUnavailable` if this host cannot confine."""
    if isinstance(code_or_argv, str):
        program = [sys.executable, "-I", "-c", code_or_argv]
    else:
        program = list(code_or_argv)
    limits = [str(memory_bytes), str(max(1, int(timeout_s) + 1)), str(nproc)]
    limits.append(str(confinement.FILE_SIZE_LIMIT))
    starter = [sys.executable, "-I", "-c", _LIMITS, *limits, *program]
    env = confinement.worker_env(True)
    argv = confinement.command(starter, [], proc=False, env=env)  # nested: no /proc to mount
    data = stdin.encode() if isinstance(stdin, str) else stdin
    process = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        out, err, timed_out = _communicate(process, data, timeout_s, max_output_bytes)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    code = process.returncode
    return UntrustedResult(returncode=code, stdout=out, stderr=err, timed_out=timed_out)


def _communicate(
    process: subprocess.Popen[bytes], data: bytes, timeout_s: float, limit: int
) -> tuple[bytes, bytes, bool]:
    """Feed ``data``, collect at most ``limit`` bytes of each output until both close or the
    deadline; True when the deadline came first."""
    assert process.stdin and process.stdout and process.stderr
    deadline = time.monotonic() + timeout_s
    kept: dict[int, bytearray] = {}
    pending = memoryview(data)
    out_fd, err_fd = process.stdout.fileno(), process.stderr.fileno()
    with selectors.DefaultSelector() as selector:
        for stream in (process.stdout, process.stderr):
            os.set_blocking(stream.fileno(), False)
            kept[stream.fileno()] = bytearray()
            selector.register(stream.fileno(), selectors.EVENT_READ)
        stdin_fd = process.stdin.fileno()
        if pending:
            os.set_blocking(stdin_fd, False)
            selector.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            process.stdin.close()
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(kept[out_fd]), bytes(kept[err_fd]), True
            for key, _ in selector.select(remaining):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        pending = pending[os.write(fd, pending[:65536]) :]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(fd)
                        process.stdin.close()
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    selector.unregister(fd)
                    continue
                room = limit - len(kept[fd])
                if room > 0:
                    kept[fd] += chunk[:room]
    out, err = kept[out_fd], kept[err_fd]
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(max(0.0, deadline - time.monotonic()))
    return bytes(out), bytes(err), process.returncode is None

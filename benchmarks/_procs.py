"""Child processes of a benchmark: spawned (no GIL shared, nothing inherited), each reporting
on one queue of tuples whose first item names the kind of message. A child's exception reaches
the parent with its traceback, a child that dies without one (a signal, the OOM killer) is named
with its exit code, and every child is joined, or killed if it does not end, when the group
closes."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any, Self


class ChildFailed(RuntimeError):
    """A child raised, died, or sent a message of a kind the parent did not wait for."""


def _child(target: Callable[..., Any], name: str, results: mp.Queue, args: tuple) -> None:
    try:
        target(*args)
    except BaseException:
        results.put(("error", name, traceback.format_exc()))
        raise


class Children:
    """Spawned processes sharing the queue ``results``; a context manager that closes them.

    ``timeout_s`` bounds each :meth:`get`; ``join_s`` is how long :meth:`close` waits for the
    children to end before it kills them. ``stop`` is an event :meth:`close` sets first, for
    children that run until told to end."""

    def __init__(self, timeout_s: float, join_s: float = 10.0) -> None:
        self.ctx = mp.get_context("spawn")
        self.results: mp.Queue = self.ctx.Queue()
        self.stop = self.ctx.Event()
        self.timeout_s = timeout_s
        self.join_s = join_s
        self.procs: list[mp.Process] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, target: Callable[..., Any], *args: Any, name: str) -> mp.Process:
        """Run ``target(*args)`` in a new child called ``name`` (pass ``self.results`` and
        ``self.stop`` in ``args`` where the target wants them)."""
        proc = self.ctx.Process(
            target=_child, args=(target, name, self.results, args), name=name, daemon=True
        )
        proc.start()
        self.procs.append(proc)
        return proc

    def get(self, *kinds: str) -> tuple:
        """The next message, which must be of one of ``kinds``; a child's exception, a child's
        death and a message of another kind raise :class:`ChildFailed`, ``timeout_s`` without a
        message :class:`TimeoutError`."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {' or '.join(kinds)} message within {self.timeout_s} s")
            try:
                message = self.results.get(timeout=min(1.0, left))
            except queue.Empty:
                dead = [f"{p.name} (exit code {p.exitcode})" for p in self.procs if p.exitcode]
                if not dead:
                    continue
                try:  # a child that raised sent its traceback just before it ended
                    message = self.results.get(timeout=1.0)
                except queue.Empty:
                    raise ChildFailed(f"child process died: {', '.join(dead)}") from None
            if message[0] == "error":
                raise ChildFailed(f"child process {message[1]} failed:\n{message[2]}")
            if message[0] not in kinds:
                raise ChildFailed(f"expected {' or '.join(kinds)}, got {message!r:.300}")
            return message

    def each(self, kind: str) -> list[tuple]:
        """One message of ``kind`` per child, in the order they come."""
        return [self.get(kind) for _ in self.procs]

    def close(self) -> None:
        """Set ``stop``, wait up to ``join_s`` for every child to end, kill the rest."""
        self.stop.set()
        deadline = time.monotonic() + self.join_s
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)

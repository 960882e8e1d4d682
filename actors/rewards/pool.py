"""A bounded pool of reward worker processes with a per-call time limit.

Each call goes to an idle worker (:mod:`actors.rewards.worker`); at most ``workers`` calls run at
once. A call that raises, returns something unusable, outlives ``timeout_s``, kills its worker,
or whose worker cannot start gives :class:`~actors.rewards.spec.RewardOutcome` with its failure
kind and the failure reward, and is counted; a worker that timed out or died is killed and
replaced, so a hanging or crashing reward never stops the actor. Only the first worker, started
in the constructor, refuses the start (a bad spec, an import error, no sandbox).

A reward file is read once, here, and every worker loads that copy (a sealed in-memory file),
so nothing that writes the file later changes the reward. Workers start in isolated mode from an
allow-listed environment (:func:`actors.rewards.sandbox.worker_env`); what they print reaches
the actor's log, at most :data:`OUTPUT_BYTES_PER_CALL` a call. Sandboxed workers
(``sandbox=True``) run each call in a fresh process confined by bubblewrap
(:mod:`actors.rewards.sandbox`).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.machinery
import itertools
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue
from typing import IO, Any

import msgpack

from actors.rewards import sandbox as confinement
from actors.rewards.spec import (
    FAILURE_KINDS,
    MAX_COMPONENTS,
    RewardOutcome,
    absolute_spec,
    combine,
    parse_reward_spec,
)
from actors.rewards.worker import BOOT, frame

log = logging.getLogger(__name__)
output_log = logging.getLogger("actors.rewards.output")

ROOT = confinement.ROOT
MAX_REPLY_BYTES = 1 << 20
"""A reply larger than this is refused (``invalid``) and its worker replaced."""
OUTPUT_BYTES_PER_CALL = 64 << 10
"""What a worker's prints may add to the actor's log per call; the rest is dropped (counted)."""
OUTPUT_LINE_BYTES = 2000
START_TIMEOUT_S = 60.0


class RewardPoolError(RuntimeError):
    """The reward function could not be started (bad spec, import error, no sandbox)."""


@dataclass(frozen=True)
class RewardCall:
    """The three arguments of one call."""

    prompt: str
    completion: str
    row: Mapping[str, Any]


class WorkerOutput(threading.Thread):
    """Forwards a worker's stderr (its prints) to the actor's log, line by line, at most
    :data:`OUTPUT_BYTES_PER_CALL` since the last :meth:`allow`; keeps a tail for errors.
    ``what`` names the worker's kind in the log (``reward``, ``env``)."""

    def __init__(self, stream: IO[bytes], label: str, what: str = "reward") -> None:
        super().__init__(name=f"{what}-output-{label}", daemon=True)
        self.stream, self.label = stream, f"{what} {label}"
        self.budget, self.dropped = OUTPUT_BYTES_PER_CALL, 0
        self.tail: deque[str] = deque(maxlen=20)
        self.start()

    def allow(self) -> None:
        self.budget = OUTPUT_BYTES_PER_CALL

    def run(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            while line := self.stream.readline(OUTPUT_LINE_BYTES):
                text = line.decode("utf-8", "replace").rstrip("\n")
                self.tail.append(text)
                if self.budget >= len(line):
                    self.budget -= len(line)
                    output_log.info("%s: %s", self.label, text)
                else:
                    if not self.dropped:
                        output_log.warning(
                            "%s: printed over %d bytes in one call; the rest of its "
                            "output is dropped",
                            self.label,
                            OUTPUT_BYTES_PER_CALL,
                        )
                    self.dropped += len(line)
        with contextlib.suppress(OSError):
            self.stream.close()


class _Worker:
    """One worker process, started on first use and after every replacement."""

    def __init__(self, pool: RewardPool, index: int) -> None:
        self.pool, self.index = pool, index
        self.process: subprocess.Popen[bytes] | None = None
        self.output: WorkerOutput | None = None

    def start(self) -> None:
        """Start the process and wait for its hello; :class:`RewardPoolError` if it failed."""
        pool = self.pool
        argv = [sys.executable, "-I", "-u", "-c", BOOT, str(ROOT), json.dumps(pool.options)]
        env = confinement.worker_env(pool.sandbox)
        if pool.sandbox:
            argv = confinement.command(argv, pool.binds, env=env)
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            pass_fds=() if pool.source_fd is None else (pool.source_fd,),
            start_new_session=True,  # its own process group: a kill takes its children too
        )
        assert self.process.stderr is not None
        self.output = WorkerOutput(self.process.stderr, f"{pool.label}[{self.index}]")
        why = start_refusal(self.read, self.stop, self.output, pool.start_timeout_s)
        if why is not None:
            raise RewardPoolError(f"task.reward={pool.spec!r} could not start: {why}")

    def call(self, call_id: int, request: bytes) -> RewardOutcome:
        """One call's outcome; the worker is stopped after a timeout, a crash or a bad reply."""
        pool = self.pool
        if self.process is None:
            try:
                self.start()
            except (RewardPoolError, confinement.SandboxUnavailable, OSError) as err:
                return pool.failed("crashed", f"the worker could not start: {err}"[:500])
        assert self.process is not None and self.process.stdin is not None
        if self.output is not None:
            self.output.allow()
        try:
            self.process.stdin.write(request)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            self.stop()
            return pool.failed("crashed", "the worker had exited")
        try:
            reply = self.read(time.monotonic() + pool.timeout_s)
        except ReplyTimeout:
            self.stop()
            return pool.failed(
                "timeout", f"no reward within task.reward_timeout_s={pool.timeout_s}"
            )
        except BadReply as err:
            self.stop()
            return pool.failed("invalid", str(err))
        if reply is None:
            code = self.stop()
            return pool.failed("crashed", f"the worker exited with {code}")
        if not isinstance(reply, dict) or "ok" not in reply or reply.get("id") != call_id:
            self.stop()  # a reply of another call (or forged) is never taken for this one's
            return pool.failed("invalid", f"unreadable reply {reply!r:.80}")
        if not reply["ok"]:
            kind = reply.get("kind") if reply.get("kind") in FAILURE_KINDS else "invalid"
            return pool.failed(kind, str(reply.get("error", ""))[:500])
        return pool.accept(combine(reply.get("value"), pool.weights, pool.failure_reward))

    def read(self, deadline: float) -> Any:
        """The next reply, or None if the worker closed its end."""
        assert self.process is not None and self.process.stdout is not None
        return read_reply(self.process.stdout.fileno(), deadline)

    def stop(self) -> int | None:
        """Kill the worker and its process group (sandboxed: its whole pid namespace); its exit
        code."""
        process, self.process = self.process, None
        code = None
        if process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            code = process.wait()
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    stream.close()
        if self.output is not None:
            self.output.join(timeout=2.0)
            self.output = None
        return code


class ReplyTimeout(Exception):
    """No whole reply before the deadline."""


class BadReply(Exception):
    """A reply over :data:`MAX_REPLY_BYTES`, or one msgpack cannot decode."""


def start_refusal(
    read: Callable[[float], Any],
    stop: Callable[[], Any],
    output: WorkerOutput | None,
    timeout_s: float,
) -> str | None:
    """None when a worker that just started says it is ready (its hello, read by ``read`` within
    ``timeout_s``); else, after ``stop``, why not, with the tail of what it printed."""
    try:
        hello = read(time.monotonic() + timeout_s)
    except ReplyTimeout:
        hello = {"error": f"no answer within {timeout_s} s"}
    except BadReply as err:
        hello = {"error": str(err)}
    if isinstance(hello, dict) and hello.get("ready"):
        return None
    stop()
    why = str(hello.get("error") if isinstance(hello, dict) else "it exited")
    tail = "\n".join(output.tail)[-1500:] if output else ""
    return why + (f"\n{tail}" if tail and why != tail else "")


def read_reply(fd: int, deadline: float) -> Any:
    """The next framed reply on ``fd`` (a worker's stdout), or None if the worker closed its
    end; :class:`ReplyTimeout` past ``deadline`` (``time.monotonic``), :class:`BadReply` for one
    over :data:`MAX_REPLY_BYTES` or undecodable."""
    header = _read_exactly(fd, 4, deadline)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > MAX_REPLY_BYTES:
        raise BadReply(f"a reply of {size} bytes (more than {MAX_REPLY_BYTES})")
    payload = _read_exactly(fd, size, deadline)
    if payload is None:
        return None
    try:
        return msgpack.unpackb(payload, raw=False)
    except Exception as err:
        raise BadReply(f"an undecodable reply ({err})") from err


def _read_exactly(fd: int, size: int, deadline: float) -> bytes | None:
    chunks, got = [], 0
    while got < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise ReplyTimeout
        chunk = os.read(fd, size - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def sealed_copy(data: bytes, name: str) -> int:
    """A read-only in-memory file holding ``data`` (sealed: nobody can change it), its fd."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def user_paths() -> list[str]:
    """Where an unsandboxed worker also finds modules: the working directory and PYTHONPATH."""
    return [os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]


def reward_code(spec: str, sandbox: bool) -> tuple[Path | None, list[str]]:
    """The file whose copy the workers load (a ``.py`` spec, or, sandboxed, a one-file module
    found in the working directory or PYTHONPATH), and the directories to show a sandbox
    read-only for a module that is a package there."""
    target, _ = parse_reward_spec(spec)
    return user_code(target, sandbox)


def user_code(target: str, sandbox: bool) -> tuple[Path | None, list[str]]:
    """:func:`reward_code` of a spec's target (a ``.py`` file or a dotted module name); the
    environment pool's too."""
    if target.endswith(".py"):
        return Path(target), []
    if not sandbox:
        return None, []
    top = target.split(".")[0]
    found = importlib.machinery.PathFinder.find_spec(top, user_paths())
    if found is None or found.origin is None:
        return None, []  # in the virtual environment or specrl: shown to the sandbox as is
    if found.submodule_search_locations:
        return None, [str(Path(found.origin).parent)]
    if "." in target:
        return None, []
    return Path(found.origin), []


class RewardPool:
    """Calls ``spec``'s function for many completions, ``workers`` at a time.

    The first worker starts in the constructor, so a bad spec, an import error or a sandbox the
    host cannot give is a :class:`RewardPoolError` at start, not a silent reward of 0.
    """

    def __init__(
        self,
        spec: str,
        *,
        workers: int = 2,
        timeout_s: float = 10.0,
        weights: Mapping[str, float] | None = None,
        failure_reward: float = 0.0,
        sandbox: bool = False,
        memory_mb: int = 1024,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.spec = absolute_spec(spec)
        self.label = self.spec.rsplit(":", 1)[-1]
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.weights = dict(weights or {})
        self.failure_reward = failure_reward
        self.sandbox, self.memory_mb = sandbox, memory_mb
        self.source_fd: int | None = None
        self.binds: list[str] = []
        self.options = self._options()
        self._lock = threading.Lock()
        self._failures: Counter[str] = Counter()
        self._calls = 0
        self._names: set[str] = set()
        self._ids = itertools.count(1)
        self._workers = [_Worker(self, i) for i in range(workers)]
        self._idle: SimpleQueue[_Worker] = SimpleQueue()
        for worker in self._workers:
            self._idle.put(worker)
        try:
            self._workers[0].start()
        except BaseException:
            self._close_source()
            raise
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="reward")
        self._closed = False

    def _options(self) -> dict[str, Any]:
        """What each worker is told (:func:`actors.rewards.worker.main`); takes the copy of the
        reward file and, sandboxed, checks that this host can confine."""
        if self.sandbox:
            try:
                confinement.check()
            except confinement.SandboxUnavailable as err:
                raise RewardPoolError(f"task.reward_sandbox=true: {err}") from err
        path, self.binds = reward_code(self.spec, self.sandbox)
        options: dict[str, Any] = {"spec": self.spec, "paths": [], "parent": None}
        if path is not None:
            try:
                data = path.read_bytes()
            except OSError as err:
                raise RewardPoolError(f"task.reward={self.spec!r}: no file {path} ({err})") from err
            self.source_fd = sealed_copy(data, f"reward-{path.stem}")
            name = self.spec.rsplit(":", 1)[-1]
            options.update(source_fd=self.source_fd, source_name=str(path))
            options["spec"] = f"{path}:{name}"
        if self.sandbox:
            options["paths"] = [str(Path(b).parent) for b in self.binds]
            cpu_s = int(self.start_timeout_s + self.timeout_s) + 1
            options["limits"] = {
                "memory_mb": self.memory_mb,
                "cpu_s": cpu_s,
                "nproc": confinement.NPROC_LIMIT,
                "file_size": confinement.FILE_SIZE_LIMIT,
            }
            self.binds = self.binds + confinement.specrl_binds()
        else:
            options["paths"] = user_paths()
            options["parent"] = os.getpid()
        return options

    def failed(self, kind: str, detail: str) -> RewardOutcome:
        return RewardOutcome(reward=self.failure_reward, failure=kind, detail=detail)

    def accept(self, outcome: RewardOutcome) -> RewardOutcome:
        """``outcome``, or ``invalid`` when its components would take this pool past
        :data:`MAX_COMPONENTS` distinct names (each becomes a metric of the run)."""
        with self._lock:
            new = set(outcome.components) - self._names
            if len(self._names) + len(new) > MAX_COMPONENTS:
                return self.failed(
                    "invalid",
                    f"component names {sorted(new)[:5]} past the {MAX_COMPONENTS} distinct "
                    "names a reward may use in a run",
                )
            self._names |= new
        return outcome

    def score(self, calls: Sequence[RewardCall]) -> list[RewardOutcome]:
        """Every call's outcome, in order (the calls run on the pool's workers in parallel)."""
        if self._closed:
            raise RuntimeError("the reward pool is closed")
        return list(self._executor.map(self._one, calls))

    def _one(self, call: RewardCall) -> RewardOutcome:
        call_id = next(self._ids)
        request = frame(
            {"prompt": call.prompt, "completion": call.completion, "row": call.row, "id": call_id},
            lenient=True,
        )
        worker = self._idle.get()
        try:
            outcome = worker.call(call_id, request)
            if self.sandbox:
                worker.stop()  # a fresh confined process for every call
        finally:
            self._idle.put(worker)
        with self._lock:
            self._calls += 1
            if outcome.failure is not None:
                if not self._failures[outcome.failure]:
                    log.warning(
                        "reward %s: first %s failure (%s); counted, the completion gets %s",
                        self.spec,
                        outcome.failure,
                        outcome.detail,
                        self.failure_reward,
                    )
                self._failures[outcome.failure] += 1
        return outcome

    def stats(self) -> dict[str, int]:
        """Calls so far and failures by kind (every kind, zeros included)."""
        with self._lock:
            return {"calls": self._calls, **{k: self._failures[k] for k in FAILURE_KINDS}}

    def _close_source(self) -> None:
        if self.source_fd is not None:
            os.close(self.source_fd)
            self.source_fd = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        for worker in self._workers:
            worker.stop()
        self._close_source()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

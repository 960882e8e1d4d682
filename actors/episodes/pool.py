"""Environment worker processes (``env.workers > 0``): the sessions of multi-turn episodes run
out of the actor's process, with the protections the reward pool gives rewards.

:class:`EnvPool` starts ``workers`` processes (:mod:`actors.episodes.env_worker`); each holds
several *sessions*, one per episode, each with its own environment object. A session goes to the
worker holding the fewest open ones; :meth:`EnvPool.session` gives its parent-side proxy,
:class:`PooledEnv`, which answers like :class:`~actors.episodes.env.CheckedEnv` (``reset``,
``step`` -> :class:`~actors.episodes.env.StepResult`, ``close``), so the episode runner uses
either unchanged. A worker answers one request at a time (a lock per worker): sessions of one
worker take turns, sessions of different workers run in parallel.

Each request has a deadline (``env.reset_timeout_s``, ``env.step_timeout_s``, from the call,
waiting for the worker included). What goes wrong is an :class:`~actors.episodes.env.EnvFailure`
of the session, counted by kind (:meth:`EnvPool.stats`):

- the environment raised: ``raised``; it answered something of the wrong type or shape (a
  non-text observation, a NaN reward, a flag that is not a bool): ``invalid``. The worker is
  kept; the answer is checked twice, in the worker and again here (the environment's code can
  write to the reply channel);
- the worker died (a segfault, ``os._exit``, an OOM kill): ``crashed`` for the call; the worker
  is replaced;
- no answer by the deadline: ``timeout``; the worker's process group is SIGKILLed and replaced;
- a reply over :data:`~actors.rewards.pool.MAX_REPLY_BYTES` (1 MiB) or one that cannot be
  read: ``invalid``, and the worker is replaced as after a crash.

The other sessions of a replaced worker lost their environments with it. Each is rebuilt on the
new worker at its next call by replaying its reset and steps, every answer compared with the one
its episode already holds (:meth:`EnvPool._replay`): a deterministic environment (given its seed
and the actions) goes on exactly as before; one whose answers differ fails ``crashed``. A call
waits for its worker at most as long as its neighbours' calls may last (a deadline for each
session of the worker) before its own deadline starts.

Reused from the reward pool (:mod:`actors.rewards.pool`, :mod:`actors.rewards.worker`,
:mod:`actors.rewards.sandbox`): the isolated start from an allow-listed environment
(:func:`~actors.rewards.sandbox.worker_env`), the framing (a 4-byte length and msgpack), the
deadline reads and the reply cap, the worker's own process group killed on a failure, the
parent-death signal, the forwarding of the worker's prints to the actor's log, the sealed
in-memory copy of a ``.py`` environment file (read once, at start: a later write to the file
changes nothing), and with ``sandbox=True`` (``env.sandbox``) bubblewrap around every worker
with its address-space, file-size and process limits (no CPU-time limit: a worker lives as
long as the actor), refused at start where this host cannot confine. The first worker starts in
the constructor, so a bad ``env.name``, an import error or a missing sandbox stops the actor at
start (:class:`EnvPoolError`); the others start on first use, and a replaced worker on the next
call that needs it.
"""

from __future__ import annotations

import contextlib
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
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from actors.episodes.env import FAILURE_KINDS, CheckedEnv, EnvFailure, StepResult
from actors.episodes.env_worker import BOOT
from actors.rewards import sandbox as confinement
from actors.rewards.pool import (
    BadReply,
    ReplyTimeout,
    WorkerOutput,
    read_reply,
    sealed_copy,
    start_refusal,
    user_code,
    user_paths,
)
from actors.rewards.worker import frame
from common.config.env import BUILTIN_ENVS, env_spec_refusal

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
MEMORY_MB = 4096
"""``env.sandbox``: the address-space limit of each worker (all its sessions together)."""
CLOSE_WAIT_S = 2.0
"""How long :meth:`EnvPool.close` lets a worker close its sessions' environments before the
kill."""


class EnvPoolError(RuntimeError):
    """The environment could not be started in a worker (bad spec, import error, no sandbox)."""


class _EnvWorker:
    """One worker process, started on first use and after every replacement. ``generation``
    counts its replacements: a session bound to an older one lost its environment."""

    def __init__(self, pool: EnvPool, index: int) -> None:
        self.pool, self.index = pool, index
        self.process: subprocess.Popen[bytes] | None = None
        self.output: WorkerOutput | None = None
        self.lock = threading.Lock()
        """Held for a request and its reply (and a start)."""
        self.generation = 0
        self.sessions = 0
        """Open sessions (the least-loaded choice)."""
        self.drops: list[int] = []
        """Sessions closed since the last request, for the worker to forget with the next."""

    def start(self) -> None:
        """Start the process and wait for its hello; :class:`EnvPoolError` if it failed."""
        pool = self.pool
        argv = [sys.executable, "-I", "-u", "-c", BOOT, str(confinement.ROOT), pool.options_json]
        env = confinement.worker_env(pool.sandbox)
        if pool.sandbox:
            argv = confinement.command(argv, pool.binds, env=env)
        # Started from the pool's own thread: the worker's parent-death signal fires when the
        # thread that started it ends, and the runner's threads end with each batch.
        self.process = pool.spawner.submit(
            subprocess.Popen,
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            pass_fds=() if pool.source_fd is None else (pool.source_fd,),
            start_new_session=True,  # its own process group: a kill takes its children too
        ).result()
        assert self.process.stderr is not None and self.process.stdin is not None
        os.set_blocking(self.process.stdin.fileno(), False)  # writes keep the deadline too
        self.output = WorkerOutput(self.process.stderr, f"{pool.label}[{self.index}]", "env")
        why = start_refusal(self.read, self.stop, self.output, pool.start_timeout_s)
        if why is not None:
            raise EnvPoolError(f"env.name={pool.spec!r} could not start in a worker process: {why}")

    def read(self, deadline: float) -> Any:
        assert self.process is not None and self.process.stdout is not None
        return read_reply(self.process.stdout.fileno(), deadline)

    def write(self, data: bytes, deadline: float) -> None:
        """``data`` to the worker's stdin by ``deadline`` (a worker that stopped reading cannot
        block the caller); :class:`ReplyTimeout` past it."""
        assert self.process is not None and self.process.stdin is not None
        fd, view = self.process.stdin.fileno(), memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([], [fd], [], remaining)[1]:
                raise ReplyTimeout
            with contextlib.suppress(BlockingIOError):
                view = view[os.write(fd, view) :]

    def request(self, message: dict[str, Any], deadline: float, what: str) -> Any:
        """The value of one request (the lock held); EnvFailure on any failure, the worker
        stopped (to be replaced) after a crash, a timeout or an unreadable reply."""
        try:
            self.write(frame(message, lenient=True), deadline)
            reply = self.read(deadline)
        except (BrokenPipeError, ConnectionResetError):
            raise EnvFailure("crashed", f"the worker had exited ({self.stop()})") from None
        except ReplyTimeout:
            self.stop()
            raise EnvFailure("timeout", f"no answer within {what}") from None
        except BadReply as err:
            self.stop()
            raise EnvFailure("invalid", str(err)) from None
        if reply is None:
            raise EnvFailure("crashed", f"the worker exited with {self.stop()}")
        if not isinstance(reply, dict) or "ok" not in reply or reply.get("id") != message["id"]:
            self.stop()  # a reply of another call (or forged) is never taken for this one's
            raise EnvFailure("invalid", f"unreadable reply {reply!r:.80}")
        if not reply["ok"]:
            kind = reply.get("kind") if reply.get("kind") in ("raised", "invalid") else "invalid"
            raise EnvFailure(kind, str(reply.get("error", ""))[:500])
        return reply.get("value")

    def take_drops(self) -> list[int]:
        with self.pool.lock:
            drops, self.drops = self.drops, []
        return drops

    def stop(self) -> int | None:
        """Kill the worker and its process group (sandboxed: its whole pid namespace); its exit
        code. Every session it held is lost (a new generation)."""
        process, self.process = self.process, None
        with self.pool.lock:
            self.generation += 1
            self.drops = []
            if process is not None:
                self.pool.restarts += 1
        return _kill(process, self.output) if process is not None else None

    def close(self) -> None:
        """Let the worker close its sessions' environments (its stdin closed: it closes them
        all and exits), then kill what is left of its process group."""
        with self.lock:
            process, self.process = self.process, None
            if process is None:
                return
            with contextlib.suppress(OSError, ValueError):
                assert process.stdin is not None
                process.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=CLOSE_WAIT_S)
            _kill(process, self.output)


def _held(value: Any) -> Any:
    """What an episode keeps of an answer (the observation, and a step's reward and flags):
    ``info``, last, is left out of a replay's comparison (it may hold addresses, timings)."""
    return value[:-1] if isinstance(value, list | tuple) and value else value


def _kill(process: subprocess.Popen[bytes], output: WorkerOutput | None) -> int | None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    code = process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    if output is not None:
        output.join(timeout=2.0)
    return code


class PooledEnv:
    """One session on a worker of an :class:`EnvPool`; answers like
    :class:`~actors.episodes.env.CheckedEnv`. Calls of one session come one at a time (the
    runner's); calls of different sessions may come from many threads at once."""

    enforces_deadlines = True
    """Each call ends by its deadline here (its worker killed if need be): the runner calls it
    on its own thread, with no watcher thread of its own."""

    def __init__(self, pool: EnvPool, worker: _EnvWorker, session: int) -> None:
        self.pool, self.worker, self.session = pool, worker, session
        self.generation: int | None = None
        """The worker's generation that holds the session's environment."""
        self.log: list[tuple[dict[str, Any], Any]] = []
        """Each request of the session and its answer, replayed on a new worker if its own is
        replaced (:meth:`EnvPool._replay`)."""
        self.closed = False

    def reset(self, *, seed: int, options: Mapping[str, Any] | None = None) -> tuple[Any, dict]:
        message = {"op": "reset", "seed": int(seed), "options": dict(options or {})}
        value = self.pool.call(self, message, self.pool.reset_timeout_s, "env.reset_timeout_s")
        return self.pool.checker.check_reset(value)

    def step(self, action: str) -> StepResult:
        message = {"op": "step", "action": str(action)}
        value = self.pool.call(self, message, self.pool.step_timeout_s, "env.step_timeout_s")
        return self.pool.checker.check_step(value)

    def close(self) -> None:
        """Forget the session (its environment is closed with the worker's next request)."""
        self.pool.release(self)


class EnvPool:
    """Sessions of ``spec``'s environment over ``workers`` worker processes (module docstring).

    The first worker starts in the constructor, so a bad spec, an import error, ``kwargs`` the
    constructor refuses or a sandbox the host cannot give is an :class:`EnvPoolError` at start.
    """

    def __init__(
        self,
        spec: str,
        kwargs: Mapping[str, Any] | None = None,
        *,
        workers: int = 2,
        max_abs_reward: float = 1e6,
        reset_timeout_s: float = 60.0,
        step_timeout_s: float = 30.0,
        sandbox: bool = False,
        memory_mb: int = MEMORY_MB,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if min(reset_timeout_s, step_timeout_s) <= 0:
            raise ValueError("the reset and step timeouts must be > 0")
        refusal = env_spec_refusal(spec)
        if refusal is not None:
            raise EnvPoolError(refusal)
        self.spec, self.kwargs = spec, dict(kwargs or {})
        self.label = spec.rsplit(":", 1)[-1]
        self.reset_timeout_s, self.step_timeout_s = reset_timeout_s, step_timeout_s
        self.start_timeout_s = start_timeout_s
        self.sandbox, self.memory_mb = sandbox, memory_mb
        self.max_abs_reward = max_abs_reward
        self.checker = CheckedEnv(None, max_abs_reward=max_abs_reward, name=spec)
        """Checks every answer again here (its ``check_*`` methods only: no event loop)."""
        self.source_fd: int | None = None
        self.binds: list[str] = []
        self.options_json = json.dumps(self._options(), default=str)
        self.lock = threading.Lock()
        """Guards the counters, the session counts and the drop lists."""
        self.failures: Counter[str] = Counter()
        self.calls = self.restarts = self.replays = self.replays_failed = 0
        self._ids = itertools.count(1)
        self._workers = [_EnvWorker(self, i) for i in range(workers)]
        self._closed = False
        self.spawner = ThreadPoolExecutor(1, thread_name_prefix="env-spawn")
        """Starts every worker: a thread that lives as long as the pool."""
        try:
            with self._workers[0].lock:
                self._workers[0].start()
        except BaseException:
            self.spawner.shutdown()
            self._close_source()
            raise

    def _options(self) -> dict[str, Any]:
        """What each worker is told (:func:`actors.episodes.env_worker.main`); takes the copy of
        a ``.py`` environment file and, sandboxed, checks that this host can confine."""
        if self.sandbox:
            try:
                confinement.check()
            except confinement.SandboxUnavailable as err:
                raise EnvPoolError(f"env.sandbox=true: {err}") from err
        options: dict[str, Any] = {
            "spec": self.spec,
            "kwargs": self.kwargs,
            "max_abs_reward": self.max_abs_reward,
            "paths": [],
            "parent": None,
        }
        path, self.binds = None, []
        if self.spec not in BUILTIN_ENVS:
            target, _, name = self.spec.rpartition(":")
            path, self.binds = user_code(target, self.sandbox)
        if path is not None:
            path = path.resolve()
            try:
                data = path.read_bytes()
            except OSError as err:
                raise EnvPoolError(f"env.name={self.spec!r}: no file {path} ({err})") from err
            self.source_fd = sealed_copy(data, f"env-{path.stem}")
            options.update(source_fd=self.source_fd, spec=f"{path}:{name}")
        if self.sandbox:
            options["paths"] = [str(Path(b).parent) for b in self.binds]
            options["limits"] = {
                "memory_mb": self.memory_mb,
                "cpu_s": -1,  # RLIM_INFINITY: a worker lives as long as the actor
                "nproc": confinement.NPROC_LIMIT,
                "file_size": confinement.FILE_SIZE_LIMIT,
            }
            self.binds = self.binds + confinement.specrl_binds()
        else:
            options["paths"] = user_paths()
            options["parent"] = os.getpid()
        return options

    def session(self) -> PooledEnv:
        """A new session on the worker with the fewest open ones."""
        if self._closed:
            raise RuntimeError("the environment pool is closed")
        with self.lock:
            worker = min(self._workers, key=lambda w: w.sessions)
            worker.sessions += 1
        return PooledEnv(self, worker, next(self._ids))

    def release(self, env: PooledEnv) -> None:
        """``env``'s session closed: its worker forgets it with its next request."""
        with self.lock:
            if env.closed:
                return
            env.closed = True
            worker = env.worker
            worker.sessions -= 1
            if env.generation is not None and env.generation == worker.generation:
                worker.drops.append(env.session)

    def call(self, env: PooledEnv, message: dict[str, Any], timeout_s: float, what: str) -> Any:
        """The value of one request of ``env``'s session within ``timeout_s``, waiting for its
        worker included; EnvFailure (counted) otherwise."""
        try:
            return self._call(env, message, timeout_s, what)
        except EnvFailure as err:
            if err.kind == "timeout":
                self.release(env)  # the runner does not close a session that timed out
            with self.lock:
                self.calls += 1
                first = not self.failures[err.kind]
                self.failures[err.kind] += 1
            if first:
                log.warning("environment %s: first %s failure (%s)", self.spec, err.kind, err)
            raise

    def _call(self, env: PooledEnv, message: dict[str, Any], timeout_s: float, what: str) -> Any:
        worker, limit = env.worker, f"{what}={timeout_s:g}"
        if env.closed or self._closed:
            raise EnvFailure("crashed", "the session or the environment pool was closed")
        # Each neighbour's call ends within its own deadline (its worker killed if need be):
        # wait that long for each session of the worker, then this call's own deadline starts.
        longest = max(self.step_timeout_s, self.reset_timeout_s)
        if not worker.lock.acquire(timeout=timeout_s + longest * max(worker.sessions, 1)):
            raise EnvFailure("timeout", f"its worker was busy with other sessions past {limit}")
        try:
            if self._closed:  # closed while this call waited: never start a worker again
                raise EnvFailure("crashed", "the environment pool was closed")
            if worker.process is None:
                try:
                    worker.start()
                except (EnvPoolError, confinement.SandboxUnavailable, OSError) as err:
                    raise EnvFailure("crashed", f"the worker could not start: {err}"[:500]) from err
            if env.generation is not None and env.generation != worker.generation:
                self._replay(env, worker, timeout_s, limit)
            if env.generation is None:
                env.generation = worker.generation
            value = self._request(env, worker, message, timeout_s, limit)
            env.log.append((dict(message), value))
        finally:
            worker.lock.release()
        with self.lock:
            self.calls += 1
        return value

    def _request(
        self, env: PooledEnv, worker: _EnvWorker, message: dict[str, Any], timeout_s: float, limit
    ) -> Any:
        """One request of ``env``'s session to ``worker`` (its lock held), by its deadline."""
        if worker.output is not None:
            worker.output.allow()  # its prints: at most OUTPUT_BYTES_PER_CALL a call
        sent = {**message, "id": next(self._ids), "session": env.session}
        sent["drop"] = worker.take_drops()
        return worker.request(sent, time.monotonic() + timeout_s, limit)

    def _replay(self, env: PooledEnv, worker: _EnvWorker, timeout_s: float, limit: str) -> None:
        """``env``'s worker was replaced (another session on it crashed, hung or sent an
        oversize reply): rebuild the session on the new worker by replaying its reset and
        steps, each answer compared with the one the episode already holds (:func:`_held`: its
        ``info`` left out). Equal answers
        (a deterministic environment): the session goes on, exactly as it was. Otherwise, or
        if the replay fails: ``crashed``."""
        log, env.log = env.log, []
        env.generation = worker.generation
        try:
            for message, recorded in log:
                again = self._request(env, worker, message, timeout_s, limit)
                if _held(again) != _held(recorded):
                    raise EnvFailure(
                        "crashed",
                        "its worker was replaced (another session on it crashed, hung or sent "
                        "an oversize reply) and replaying the session gave another answer: the "
                        "environment is not deterministic given its seed and actions",
                    )
                env.log.append((message, again))
        except EnvFailure as err:
            with self.lock:
                self.replays_failed += 1
            raise EnvFailure("crashed", f"replay after its worker was replaced: {err}") from err
        with self.lock:
            self.replays += 1

    def stats(self) -> dict[str, int]:
        """Calls so far, failures by kind (every kind, zeros included), workers replaced, and
        sessions replayed onto a new worker (and replays that failed)."""
        with self.lock:
            failures = {k: self.failures[k] for k in FAILURE_KINDS}
            return {
                "calls": self.calls,
                "restarts": self.restarts,
                "replays": self.replays,
                "replays_failed": self.replays_failed,
                **failures,
            }

    def pids(self) -> list[int]:
        """The worker processes running now (for tests and the operator)."""
        return [w.process.pid for w in self._workers if w.process is not None]

    def _close_source(self) -> None:
        if self.source_fd is not None:
            os.close(self.source_fd)
            self.source_fd = None

    def close(self) -> None:
        """Close every session's environment (a short wait), then kill every worker."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.close()
        self.spawner.shutdown()
        self._close_source()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

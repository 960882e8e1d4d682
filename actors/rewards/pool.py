"""A bounded pool of reward worker processes with a per-call time limit.

Each call goes to an idle worker (``python -m actors.rewards.worker``); at most ``workers`` calls
run at once. A call that raises, returns something unusable, outlives ``timeout_s`` or kills its
worker gives :class:`~actors.rewards.spec.RewardOutcome` with its failure kind and the failure
reward, and is counted; a worker that timed out or died is killed and replaced, so a hanging or
crashing reward never stops the actor. Sandboxed workers (``sandbox=True``) run each call in a
fresh confined process (:func:`actors.rewards.worker.confine`) in an empty directory, with an
environment of PATH, HOME and PYTHONPATH only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue
from typing import Any

import msgpack

from actors.rewards.spec import FAILURE_KINDS, RewardOutcome, absolute_spec, combine
from actors.rewards.worker import frame

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
MAX_REPLY_BYTES = 1 << 20
"""A reply larger than this is refused (``invalid``) and its worker replaced."""
SECRET_ENV_PREFIXES = ("SPECRL_",)
"""Environment variables a worker never inherits (the Redis password, the actor token...)."""


class RewardPoolError(RuntimeError):
    """The reward function could not be started (bad spec, import error, no sandbox)."""


@dataclass(frozen=True)
class RewardCall:
    """The three arguments of one call."""

    prompt: str
    completion: str
    row: Mapping[str, Any]


class _Worker:
    """One worker process, started on first use and after every replacement."""

    def __init__(self, pool: RewardPool) -> None:
        self.pool = pool
        self.process: subprocess.Popen[bytes] | None = None
        self.home: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> None:
        pool = self.pool
        argv = [sys.executable, "-m", "actors.rewards.worker", pool.spec]
        python_path = [str(ROOT), os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])]
        if pool.sandbox:
            self.home = tempfile.TemporaryDirectory(prefix="specrl-reward-")
            argv += ["--sandbox", str(pool.memory_mb)]
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": self.home.name}
            cwd: str | None = self.home.name
        else:
            env = {k: v for k, v in os.environ.items() if not k.startswith(SECRET_ENV_PREFIXES)}
            cwd = None
        env["PYTHONPATH"] = os.pathsep.join(python_path)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,  # its own process group: a kill takes its children too
        )
        hello = self.read(time.monotonic() + pool.start_timeout_s)
        if not isinstance(hello, dict) or not hello.get("ready"):
            self.stop()
            why = hello.get("error") if isinstance(hello, dict) else "no answer"
            raise RewardPoolError(f"task.reward={pool.spec!r} could not start: {why}")

    def call(self, request: bytes) -> RewardOutcome:
        """One call's outcome; the worker is stopped after a timeout, a crash or a bad reply."""
        pool = self.pool
        if self.process is None:
            self.start()
        assert self.process is not None and self.process.stdin is not None
        try:
            self.process.stdin.write(request)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            self.stop()
            return pool.failed("crashed", "the worker had exited")
        try:
            reply = self.read(time.monotonic() + pool.timeout_s)
        except _Timeout:
            self.stop()
            return pool.failed(
                "timeout", f"no reward within task.reward_timeout_s={pool.timeout_s}"
            )
        except _BadReply as err:
            self.stop()
            return pool.failed("invalid", str(err))
        if reply is None:
            code = self.stop()
            return pool.failed("crashed", f"the worker exited with {code}")
        if not isinstance(reply, dict) or "ok" not in reply:
            self.stop()
            return pool.failed("invalid", f"unreadable reply {reply!r:.80}")
        if not reply["ok"]:
            kind = reply.get("kind") if reply.get("kind") in FAILURE_KINDS else "invalid"
            return pool.failed(kind, str(reply.get("error", ""))[:500])
        return combine(reply.get("value"), pool.weights, pool.failure_reward)

    def read(self, deadline: float) -> Any:
        """The next reply, or None if the worker closed its end."""
        header = self._read_exactly(4, deadline)
        if header is None:
            return None
        size = int.from_bytes(header, "big")
        if size > MAX_REPLY_BYTES:
            raise _BadReply(f"a reply of {size} bytes (more than {MAX_REPLY_BYTES})")
        payload = self._read_exactly(size, deadline)
        if payload is None:
            return None
        try:
            return msgpack.unpackb(payload, raw=False)
        except Exception as err:
            raise _BadReply(f"an undecodable reply ({err})") from err

    def _read_exactly(self, size: int, deadline: float) -> bytes | None:
        assert self.process is not None and self.process.stdout is not None
        fd = self.process.stdout.fileno()
        chunks, got = [], 0
        while got < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise _Timeout
            chunk = os.read(fd, size - got)
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def stop(self) -> int | None:
        """Kill the worker and its process group; its exit code."""
        process, self.process = self.process, None
        code = None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            code = process.wait()
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    stream.close()
        if self.home is not None:
            self.home.cleanup()
            self.home = None
        return code


class _Timeout(Exception):
    pass


class _BadReply(Exception):
    pass


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
        start_timeout_s: float = 60.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.spec = absolute_spec(spec)
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.weights = dict(weights or {})
        self.failure_reward = failure_reward
        self.sandbox, self.memory_mb = sandbox, memory_mb
        self._lock = threading.Lock()
        self._failures: Counter[str] = Counter()
        self._calls = 0
        self._workers = [_Worker(self) for _ in range(workers)]
        self._idle: SimpleQueue[_Worker] = SimpleQueue()
        for worker in self._workers:
            self._idle.put(worker)
        self._workers[0].start()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="reward")
        self._closed = False

    def failed(self, kind: str, detail: str) -> RewardOutcome:
        return RewardOutcome(reward=self.failure_reward, failure=kind, detail=detail)

    def score(self, calls: Sequence[RewardCall]) -> list[RewardOutcome]:
        """Every call's outcome, in order (the calls run on the pool's workers in parallel)."""
        if self._closed:
            raise RuntimeError("the reward pool is closed")
        return list(self._executor.map(self._one, calls))

    def _one(self, call: RewardCall) -> RewardOutcome:
        request = frame(
            {"prompt": call.prompt, "completion": call.completion, "row": call.row}, lenient=True
        )
        worker = self._idle.get()
        try:
            outcome = worker.call(request)
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

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        for worker in self._workers:
            worker.stop()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

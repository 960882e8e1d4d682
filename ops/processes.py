"""The pipeline's processes (learner, actors) as OS children of the operator: each one started as
``python -m MODULE OVERRIDES...`` with its own log file, watched, stopped, killed and restarted.

``specrl run`` (ops/launcher.py), the chaos run (benchmarks/chaos.py) and the integration tests
(testing/pipeline.py) all start and stop the pipeline through this module.
Every child gets the kernel's parent-death signal (ops/redis_server.py), so not even a SIGKILL of
the operator leaves orphans.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from ops.redis_server import child_preexec

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
STOP_GRACE_S = 20.0


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, unbuffered output, and the repository first on PYTHONPATH."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class Process:
    """One child ``python -m module *args`` whose output is appended to ``log_path``, run in
    ``cwd`` (this process's directory if None); ``start`` again after it exited restarts it with
    the same arguments and log."""

    def __init__(
        self,
        name: str,
        module: str,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.args = list(args)
        self.log_path = log_path
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> Process:
        if self.running():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(self.env),
                cwd=self.cwd,
                preexec_fn=child_preexec(),
            )
        return self

    def _popen(self) -> subprocess.Popen:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.proc

    @property
    def pid(self) -> int:
        return self._popen().pid

    @property
    def returncode(self) -> int | None:
        return self._popen().returncode

    def poll(self) -> int | None:
        return self._popen().poll()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        return self._popen().wait(timeout=timeout)

    def send_signal(self, signum: int) -> None:
        if self.running():
            self._popen().send_signal(signum)

    def kill(self) -> None:
        """SIGKILL, no clean exit (``wait`` reaps it)."""
        self.send_signal(signal.SIGKILL)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM (after SIGCONT, should it be frozen), SIGKILL after ``grace_s``: its exit code,
        None if it had to be killed."""
        return stop_all([self], grace_s)[self.name]

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def failure(self) -> str:
        """One line on why it exited with an error: see ``child_failure``."""
        return child_failure(self.name, self.log_path, self.returncode)


def stop_all(processes: Iterable[Process], grace_s: float = STOP_GRACE_S) -> dict[str, int | None]:
    """Stop every process at once (SIGCONT and SIGTERM to all, then a common deadline; SIGKILL
    for whatever is still up then): exit code by name, None for those killed."""
    started = [p for p in processes if p.proc is not None]
    for p in started:
        if p.running():
            p.send_signal(signal.SIGCONT)
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    codes: dict[str, int | None] = {}
    for p in started:
        try:
            codes[p.name] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs; killing it", p.name, grace_s)
            p.kill()
            p.wait()
            codes[p.name] = None
    return codes


def learner(
    run_dir: Path, args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> Process:
    """The learner, logging to ``{run_dir}/learner.log``; ``env`` adds to its environment."""
    return Process("learner", "learner.main", args, run_dir / "learner.log", env, cwd)


def actor(
    run_dir: Path,
    index: int,
    args: list[str],
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Process:
    """Actor ``index`` (``actor.index`` appended to ``args``), logging to
    ``{run_dir}/actor-{index}.log``."""
    name = f"actor-{index}"
    args = [*args, f"actor.index={index}"]
    return Process(name, "actors.main", args, run_dir / f"{name}.log", env, cwd)


def child_failure(name: str, log_path: Path, code: int | None) -> str:
    """One line for a child that exited with ``code``: its last exception (type and message, as
    the end of its traceback in the log says) and the log's path."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    reason = ""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call")]
    if starts:
        tail = [line for line in lines[starts[-1] + 1 :] if line and not line[0].isspace()]
        if tail:
            reason = tail[0]
    if not reason:
        errors = [line for line in lines if " ERROR " in line or " CRITICAL " in line]
        reason = errors[-1] if errors else ""
    what = f"{name} exited with code {code}"
    return f"{what}: {reason} (log: {log_path})" if reason else f"{what} (log: {log_path})"

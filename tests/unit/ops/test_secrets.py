"""Secrets stay off command lines (any local user reads /proc/<pid>/cmdline) and out of saved
configs; CurveZMQ secret keys are never readable by others, not even for a moment."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import redis
import yaml
import zmq.auth.certs

from common.config import load_config, redacted_yaml
from common.config.run import REDIS_PASSWORD_ENV
from common.curve_keys import actor_keys, learner_keys
from ops.keys import write_keys
from ops.launcher import child_overrides, child_secrets
from ops.processes import child_env
from ops.redis_server import RedisServer

# Characters a shell, a URL and redis.conf each treat specially.
PASSWORD = 'Pw-7 "q" \\ @:/%#ü'


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def test_private_redis_gets_its_password_from_a_0600_file_not_argv(tmp_path):
    server = RedisServer(password=PASSWORD, data_dir=tmp_path / "redis")
    # The file holding requirepass is created 0600 whatever the umask.
    server.data_dir.mkdir()
    previous = os.umask(0)
    try:
        server._write_auth()
    finally:
        os.umask(previous)
    assert stat.S_IMODE(server.auth_path.stat().st_mode) == 0o600
    server.auth_path.unlink()
    with server:
        # The exec'd argv (what /proc shows before redis rewrites its title) and /proc now.
        argv = server._proc.args
        assert not any(PASSWORD in a or "requirepass" in a for a in argv), argv
        assert PASSWORD.encode() not in cmdline(server.pid)
        assert redis.Redis(host=server.host, port=server.port, password=PASSWORD).ping()
        try:
            redis.Redis(host=server.host, port=server.port).get("k")
            raise AssertionError("Redis answered without the password")
        except redis.AuthenticationError:
            pass
        # Read at start, then gone: nothing on disk holds the password.
        assert not server.auth_path.exists()
        for path in server.data_dir.rglob("*"):
            assert PASSWORD.encode() not in path.read_bytes(), path


def test_launcher_children_get_the_password_in_their_environment(tmp_path):
    """What the launcher gives a child (``child_overrides`` + ``child_secrets``), started as a
    real process: the password is not in its /proc cmdline, and its config connects with it."""
    url = RedisServer(password=PASSWORD, data_dir=tmp_path / "r").url  # quoted into the URL
    user = ["task=addition", f"redis.url={url}"]
    cfg = load_config([*user, f"run.dir={tmp_path}"])
    args = child_overrides(cfg, user, url, tmp_path / "model")
    probe = (
        "import sys; from common.config import load_config; "
        "print(load_config(sys.argv[1:]).redis.resolved_url(), flush=True); sys.stdin.read()"
    )
    env = child_env(child_secrets(url))
    assert env[REDIS_PASSWORD_ENV] == PASSWORD
    proc = subprocess.Popen(
        [sys.executable, "-c", probe, *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        resolved = proc.stdout.readline().strip()
        seen = cmdline(proc.pid)
        assert b"redis.url=redis://127.0.0.1:" in seen
        for form in (PASSWORD, quote(PASSWORD, safe="")):  # as typed, and as in a URL
            assert form.encode() not in seen, seen
    finally:
        proc.communicate("", timeout=30)
    assert resolved == url


def test_saved_config_redacts_the_redis_password(tmp_path):
    cfg = load_config(["redis.url=redis://:hunter2@127.0.0.1:6390/0", f"run.dir={tmp_path}"])
    text = redacted_yaml(cfg)
    assert "hunter2" not in text
    assert yaml.safe_load(text)["redis"]["url"] == "redis://:***@127.0.0.1:6390/0"
    assert cfg.redis.url == "redis://:hunter2@127.0.0.1:6390/0"  # the live config is untouched


def test_curve_secret_keys_are_born_0600_in_a_0700_directory(tmp_path, monkeypatch):
    """The mode of every key file the moment pyzmq has written it, before anything could
    chmod it: under the default umask 022 a plain write would make it 0644."""
    born: dict[str, int] = {}
    write = zmq.auth.certs._write_key_file

    def recording(path, *args, **kwargs):
        write(path, *args, **kwargs)
        born[Path(path).name] = stat.S_IMODE(os.stat(path).st_mode)

    monkeypatch.setattr(zmq.auth.certs, "_write_key_file", recording)
    previous = os.umask(0o022)
    try:
        keys = tmp_path / "new" / "keys"
        write_keys(keys, ("alice", "bob"))
        assert os.umask(0o022) == 0o022, "write_keys left its umask behind"
    finally:
        os.umask(previous)
    assert set(born) >= {"learner.key_secret", "alice.key_secret", "bob.key_secret"}
    for name, mode in born.items():
        if name.endswith(".key_secret"):
            assert mode == 0o600, (name, oct(mode))
        assert mode & 0o077 == 0, (name, oct(mode))
    for directory in (keys, keys / "authorized"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    for path in keys.rglob("*"):
        assert path.stat().st_mode & 0o077 == 0, path


def test_loading_a_secret_key_others_can_read_warns(tmp_path, caplog):
    keys = tmp_path / "keys"
    write_keys(keys)
    with caplog.at_level(logging.WARNING, logger="common.curve_keys"):
        learner_keys(keys)
        actor_keys(keys)
    assert not caplog.records
    (keys / "actor.key_secret").chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="common.curve_keys"):
        assert actor_keys(keys).secret
    (record,) = caplog.records
    assert "actor.key_secret has mode 0644" in record.getMessage()

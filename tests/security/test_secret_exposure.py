"""Secrets stay where they are put (audit M2, M3): reward workers start from an allow-listed
environment, the learner and actors are non-dumpable, the compose files give the learner and
actors no bare ``REDIS_PASSWORD``, and the trackers log the redacted config."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from actors.rewards.pool import RewardCall, RewardPool
from actors.rewards.sandbox import worker_env
from common.config import load_config
from common.entrypoint import make_non_dumpable

ROOT = Path(__file__).resolve().parents[2]
SECRETS = {
    "REDIS_PASSWORD": "pw1",
    "SPECRL_REDIS_PASSWORD": "pw2",
    "WANDB_API_KEY": "k3",
    "HF_TOKEN": "t4",
    "AWS_SECRET_ACCESS_KEY": "a5",
}


def test_an_unsandboxed_worker_sees_only_allow_listed_variables(tmp_path, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MY_SETTING", "kept")
    monkeypatch.setenv("SPECRL_REWARD_ENV", "MY_SETTING,SPECRL_REDIS_PASSWORD")
    reward = tmp_path / "env_reward.py"
    reward.write_text(
        textwrap.dedent(
            """
            import os
            def score(prompt, completion, row):
                return float(os.environ.get(row["name"], "") == row["value"])
            """
        )
    )
    with RewardPool(f"{reward}:score") as pool:
        calls = [RewardCall("p", "c", {"name": n, "value": v}) for n, v in SECRETS.items()]
        calls.append(RewardCall("p", "c", {"name": "MY_SETTING", "value": "kept"}))
        calls.append(RewardCall("p", "c", {"name": "PYTHONUNBUFFERED", "value": "1"}))
        got = [o.reward for o in pool.score(calls)]
    assert got == [0.0] * len(SECRETS) + [1.0, 1.0]


def test_the_allow_list_never_passes_a_specrl_variable():
    environ = {"PATH": "/bin", "SPECRL_X": "s", "SPECRL_REWARD_ENV": "SPECRL_X,OTHER", "OTHER": "o"}
    for confined in (True, False):
        env = worker_env(confined, environ)
        assert "SPECRL_X" not in env and env["OTHER"] == "o"
    assert worker_env(True, {"HOME": "/home/u"})["HOME"] == "/tmp"


def _environ_readable(pid: int, user: int | None) -> bool:
    done = subprocess.run(
        ["/bin/cat", f"/proc/{pid}/environ"],
        user=user,
        group=user,
        extra_groups=None if user is None else [],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0 and b"hunter2" in done.stdout


HOLDER = """
import ctypes, os, sys, time
sys.path.insert(0, sys.argv[1])
from common.entrypoint import make_non_dumpable
if os.geteuid() == 0:  # become the unprivileged user (which alone makes it non-dumpable)
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)
print(make_non_dumpable({"SPECRL_DUMPABLE": sys.argv[2]}), flush=True)
time.sleep(30)
"""


@pytest.mark.parametrize("dumpable", [True, False])
def test_a_non_dumpable_process_hides_its_environ_from_its_own_user(dumpable):
    """As root, both sides run as uid 65534: root itself reads every process's environ."""
    user = 65534 if os.geteuid() == 0 else None
    holder = subprocess.Popen(
        [sys.executable, "-I", "-c", HOLDER, str(ROOT), str(int(dumpable))],
        stdout=subprocess.PIPE,
        text=True,
        env={"SPECRL_REDIS_PASSWORD": "hunter2", "PATH": "/usr/bin:/bin"},
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == str(not dumpable)
        assert _environ_readable(holder.pid, user) is dumpable
    finally:
        holder.kill()
        holder.wait()


def test_the_learner_and_actors_make_themselves_non_dumpable(monkeypatch):
    import common.entrypoint as entrypoint

    seen = []
    monkeypatch.setattr(entrypoint, "make_non_dumpable", lambda: seen.append("called"))
    monkeypatch.setattr(sys, "argv", ["specrl-actor", "run.steps=1"])
    monkeypatch.setattr(entrypoint, "prepare", lambda *a: None)
    previous = os.umask(0o022)
    try:
        entrypoint.run_main(None, "specrl-actor", "", lambda cfg: None, role="actor")
        mask = os.umask(0o022)  # and what run_main left: files for its user alone
    finally:
        os.umask(previous)
    assert seen == ["called"]
    assert mask == 0o077
    assert make_non_dumpable({"SPECRL_DUMPABLE": "1"}) is False


def test_compose_gives_the_learner_and_actors_no_bare_redis_password():
    """Only SPECRL_REDIS_PASSWORD is read (common/config/run.py); the Redis service keeps its
    own REDIS_PASSWORD for its config file and health check."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name in ("learner", "actor"):
        env = services[name]["environment"]
        assert "REDIS_PASSWORD" not in env and "SPECRL_REDIS_PASSWORD" in env, name
        assert "$$REDIS_PASSWORD" not in str(services[name].get("healthcheck", ""))
    assert "REDIS_PASSWORD" in services["redis"]["environment"]
    code = "\n".join(p.read_text() for p in (ROOT / "common").rglob("*.py"))
    assert 'environ.get("REDIS_PASSWORD"' not in code and "REDIS_PASSWORD_ENV" in code


def test_the_trackers_log_the_redacted_config(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    from common.config import redacted_yaml
    from learner.trackers import Trackers

    cfg = load_config(
        ["redis.url=redis://:s3cretpass@db.example:6379/0", "run.report_to=[tensorboard]"]
    )
    assert "s3cretpass" not in redacted_yaml(cfg) and "***" in redacted_yaml(cfg)
    assert "s3cretpass" in cfg.redis.url  # the run itself still has it
    trackers = Trackers.open(cfg, tmp_path)
    trackers.close()
    events = b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").rglob("*") if p.is_file())
    assert events and b"s3cretpass" not in events and b"db.example" in events

"""``specrl run``'s launcher without a model: what it hands the children, what it refuses before
starting any, how it follows and stops real child processes (tiny stand-in modules)."""

from __future__ import annotations

import io
import json
import signal
import socket
import time
from pathlib import Path

import pytest
from rich.console import Console

from common.config import load_config
from ops import launcher, processes
from ops.launcher import (
    Launch,
    PreflightError,
    assign_ports,
    child_overrides,
    child_secrets,
    preflight,
)
from ops.processes import Process, child_failure

LEARNER_OK = """
import json, sys, time
from pathlib import Path
run_dir = Path(sys.argv[1])
with (run_dir / "metrics.jsonl").open("a") as f:
    for step in (1, 2):
        f.write(json.dumps({"learner/step": step, "learner/version": step}) + "\\n")
"""
CRASH = "raise RuntimeError('boom: ' + __import__('sys').argv[1])\n"
SLEEPER = "import time\nprint('up', flush=True)\ntime.sleep(60)\n"
STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print('ignoring SIGTERM', flush=True)
time.sleep(60)
"""


def child(tmp_path: Path, name: str, source: str, *args: str) -> Process:
    """A real child process running ``source`` as module ``name`` (found in ``tmp_path``)."""
    (tmp_path / f"{name.replace('-', '_')}.py").write_text(source)
    module = name.replace("-", "_")
    return Process(name, module, list(args), tmp_path / f"{name}.log", cwd=tmp_path)


def wait_for_log(proc: Process, text: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in proc.log_tail():
        assert time.monotonic() < deadline, proc.log_tail()
        time.sleep(0.05)


def follow(tmp_path: Path, children: list[Process], stop: dict | None = None) -> tuple[str, str]:
    cfg = load_config(["run.steps=2"])
    out = io.StringIO()
    console = Console(file=out, width=400)
    outcome = launcher._follow(cfg, Launch(children), tmp_path, console, stop or {"signal": 0})
    return outcome, out.getvalue()


def test_child_overrides_put_the_launchers_choices_after_the_users(tmp_path, monkeypatch):
    user = ["task=addition", "run.steps=3", "redis.url=redis://:pw@127.0.0.1:7000/0"]
    cfg = load_config([*user, "run.name=r1", f"run.dir={tmp_path}"])
    args = child_overrides(cfg, user, "redis://:pw@127.0.0.1:7000/0", tmp_path / "model")
    assert args[:2] == user[:2]
    # The password leaves the command line (the user's redis.url too); it goes in the environment.
    assert args[2:] == [
        "run.name=r1",
        f"run.dir={tmp_path}",
        "redis.url=redis://127.0.0.1:7000/0",
        f"model.path={tmp_path / 'model'}",
    ]
    assert not any("pw" in a for a in args)
    env = child_secrets("redis://:pw@127.0.0.1:7000/0")
    assert env == {"SPECRL_REDIS_PASSWORD": "pw"}
    assert child_secrets("redis://127.0.0.1:7000/0") == {}
    # The children read the same config back from these overrides and that environment.
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    again = load_config(args)
    assert (again.run.name, again.run.steps, again.task.name) == ("r1", 3, "addition")
    assert again.redis.url == "redis://127.0.0.1:7000/0"
    assert again.redis.resolved_url() == "redis://:pw@127.0.0.1:7000/0"


def test_assign_ports_fills_only_what_the_user_left_unset(tmp_path):
    cfg = load_config([])
    extra = assign_ports(cfg, [], tmp_path)
    keys = [e.split("=", 1)[0] for e in extra]
    assert keys == ["learner.address", "learner.metrics_port", "actor.metrics_port"]
    ports = json.loads((tmp_path / "ports.json").read_text())
    assert ports["learner.address"] == extra[0].split("=", 1)[1]
    assert ports["learner.address"].startswith("tcp://127.0.0.1:")

    given = ["learner.address=tcp://127.0.0.1:5999", "+actor.metrics_port=9101"]
    cfg = load_config(["learner.address=tcp://127.0.0.1:5999", "actor.metrics_port=9101"])
    assert assign_ports(cfg, given, tmp_path) == ["learner.metrics_port=0"]
    ports = json.loads((tmp_path / "ports.json").read_text())
    assert ports["learner.address"] == "tcp://127.0.0.1:5999"
    assert int(ports["actor.metrics_port"]) == 9101


def test_preflight_names_a_taken_port_only_when_the_user_gave_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        overrides = [f"learner.address=tcp://127.0.0.1:{port}"]
        with pytest.raises(PreflightError, match=f"port {port} is taken"):
            preflight(load_config(overrides), overrides)
        preflight(load_config(overrides), [])  # not given by the user: a free one is picked
        overrides = [f"learner.metrics_port={port}"]
        with pytest.raises(PreflightError, match=f"learner.metrics_port={port}: the port is taken"):
            preflight(load_config(overrides), overrides)


def test_run_with_a_preflight_error_starts_no_process(tmp_path):
    cfg = load_config([f"model.path={tmp_path}", f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(PreflightError, match="no config.json"):
        launcher.run(cfg, [], Console(file=io.StringIO()))
    assert not (tmp_path / "run").exists()


def test_follow_completes_when_the_learner_exits_cleanly(tmp_path):
    learner = child(tmp_path, "learner", LEARNER_OK, str(tmp_path)).start()
    actor = child(tmp_path, "actor-0", SLEEPER).start()
    try:
        outcome, text = follow(tmp_path, [learner, actor])
    finally:
        codes = processes.stop_all([learner, actor], grace_s=10)
    assert outcome == "completed", text
    assert codes == {"learner": 0, "actor-0": -signal.SIGTERM}


def test_follow_reports_a_failed_actor_by_name_with_its_exception(tmp_path):
    learner = child(tmp_path, "learner", SLEEPER).start()
    actor = child(tmp_path, "actor-1", CRASH, "no weights").start()
    try:
        outcome, text = follow(tmp_path, [learner, actor])
    finally:
        processes.stop_all([learner, actor], grace_s=10)
    assert outcome.startswith("actor-1 exited with code 1: RuntimeError: boom: no weights")
    assert outcome.endswith(f"(log: {tmp_path / 'actor-1.log'})")
    assert "actor-1 exited with code 1" in text
    assert learner.poll() == -signal.SIGTERM  # the learner was still running: stopped by us


def test_follow_stops_on_a_signal(tmp_path):
    learner = child(tmp_path, "learner", SLEEPER).start()
    try:
        outcome, text = follow(tmp_path, [learner], {"signal": int(signal.SIGINT)})
    finally:
        processes.stop_all([learner], grace_s=10)
    assert outcome == "interrupted"
    assert f"signal {int(signal.SIGINT)}" in text


def test_stop_all_kills_what_ignores_sigterm_and_restart_appends_to_the_log(tmp_path):
    stubborn = child(tmp_path, "learner", STUBBORN).start()
    polite = child(tmp_path, "actor-0", SLEEPER).start()
    wait_for_log(stubborn, "ignoring SIGTERM")
    wait_for_log(polite, "up")  # the restarted one appends a second line
    started = time.monotonic()
    codes = processes.stop_all([polite, stubborn], grace_s=1.0)
    assert time.monotonic() - started < 10
    assert codes == {"actor-0": -signal.SIGTERM, "learner": None}
    assert not stubborn.running() and stubborn.returncode == -signal.SIGKILL

    first_pid = polite.pid
    polite.start()
    assert polite.pid != first_pid
    wait_for_log(polite, "up\nup")
    assert polite.stop(grace_s=10) == -signal.SIGTERM
    with pytest.raises(RuntimeError, match="never started"):
        child(tmp_path, "actor-9", SLEEPER).poll()


def test_child_failure_quotes_the_last_exception_or_error_line(tmp_path):
    log = tmp_path / "x.log"
    log.write_text(
        "Traceback (most recent call last):\n  File 'a.py'\nValueError: first\n"
        "Traceback (most recent call last):\n  File 'b.py', line 3\n    x()\nKeyError: 'second'\n"
    )
    assert (
        child_failure("actor-0", log, 1)
        == f"actor-0 exited with code 1: KeyError: 'second' (log: {log})"
    )
    log.write_text("12:00 learner ERROR learner.loop: Redis is gone\nbye\n")
    assert child_failure("learner", log, 3).startswith(
        "learner exited with code 3: 12:00 learner ERROR"
    )
    assert child_failure("learner", tmp_path / "none.log", 9) == (
        f"learner exited with code 9 (log: {tmp_path / 'none.log'})"
    )

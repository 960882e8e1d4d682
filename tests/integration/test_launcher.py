"""`specrl run` end to end: private Redis, learner and actors as processes, summary and plot,
and a clean stop on SIGTERM with no orphan process."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops.processes import ROOT
from ops.redis_server import RedisServer, find_free_port
from testing.pipeline import warm_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model(tmp_path_factory.mktemp("model"))


def launch(
    run_dir: Path, model_dir: Path, extra: list[str], fixed_port: bool = True
) -> subprocess.Popen:
    """``specrl run`` in a subprocess; ``fixed_port=False`` gives no port, as a user types it."""
    args = [
        sys.executable,
        "-m",
        "ops.cli",
        "run",
        f"run.name=launch-{run_dir.name}",
        f"run.dir={run_dir}",
        f"model.path={model_dir}",
        *([f"learner.address=tcp://127.0.0.1:{find_free_port()}"] if fixed_port else []),
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def descendants(pid: int) -> set[int]:
    """All live descendants of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for_processes(proc: subprocess.Popen, n: int, timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    seen: set[int] = set()
    while time.monotonic() < deadline and proc.poll() is None:
        seen |= descendants(proc.pid)
        if len(seen) >= n:
            return seen
        time.sleep(0.2)
    return seen


def test_run_writes_summary_plot_and_metrics(tmp_path, model_dir):
    cache = tmp_path / "shm"
    extra = [
        "run.steps=12",
        "actor.num_actors=2",
        f"redis.host_cache_dir={cache}",
        "run.report_to=[tensorboard]",
        "eval.every=4",
        "eval.prompts=8",
    ]
    proc = launch(tmp_path, model_dir, extra)
    children = wait_for_processes(proc, 4, 60)  # redis + learner + 2 actors
    out, _ = proc.communicate(timeout=300)
    # The actors shared versions through the host cache; the ended run's copies are removed.
    (root,) = cache.iterdir()
    assert list(root.iterdir()) == [], list(root.iterdir())
    assert proc.returncode == 0, out
    assert len(children) >= 4, children
    assert not [p for p in children if alive(p)], "orphan processes left behind"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["steps"] == 12
    assert summary["final_version"] == 12
    # Every child left on its own within the grace period (None: it had to be killed).
    assert summary["exit_codes"] == {"learner": 0, "actor-0": 0, "actor-1": 0}, out
    assert "did not stop" not in out
    assert (tmp_path / "report.png").stat().st_size > 10_000
    assert "report.png" in (tmp_path / "report.md").read_text()
    assert "reward_last_10pct" in out and "summary" in out
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("learner/step") == 12 for r in rows)
    # run.report_to: the learner's records also reached TensorBoard, at their steps.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = {r["learner/step"]: r["learner/loss"] for r in rows if "learner/loss" in r}
    assert logged and {e.step: e.value for e in events.Scalars("learner/loss")} == pytest.approx(
        logged
    )
    # eval.every: actor 0 evaluated at the start and at every 4th version (its file holds them
    # all); metrics.jsonl, TensorBoard and the report hold those that reached a step record (an
    # evaluation superseded before the next step record is in the file only).
    (eval_file,) = (tmp_path / "eval").glob("*.jsonl")
    evaluated = [json.loads(x)["eval/version"] for x in eval_file.read_text().splitlines()]
    assert evaluated[0] == 0 and evaluated == sorted(set(evaluated)), evaluated
    evals = [r for r in rows if "eval/version" in r]
    assert evals and all(r["eval/prompts"] == 8 for r in evals), rows[-1]
    versions = [r["eval/version"] for r in evals]
    assert versions == sorted(set(versions)) and set(versions) <= set(evaluated), versions
    assert [e.value for e in events.Scalars("eval/avg_reward")] == pytest.approx(
        [r["eval/avg_reward"] for r in evals]
    )
    assert all(0.0 <= r["eval/greedy_pass"] <= r["eval/greedy_avg_reward"] <= 1.0 for r in evals)
    report = (tmp_path / "report.md").read_text()
    assert f"held-out avg@4 / pass@4, version {versions[0]:.0f}" in report, report
    assert "held-out greedy" in report


def test_sigterm_stops_everything(tmp_path, model_dir):
    proc = launch(tmp_path, model_dir, ["run.steps=100000", "actor.num_actors=2"])
    children = wait_for_processes(proc, 4, 60)
    assert len(children) >= 4, children
    # Let training get going, then stop the launcher the way a supervisor would.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (tmp_path / "metrics.jsonl").exists():
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out  # interrupted runs say so in the exit code
    assert "interrupted" in out
    assert not [p for p in children if alive(p)], "orphan processes left behind"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["outcome"] == "interrupted"
    assert list((tmp_path / "checkpoints").glob("step_*")), "learner did not checkpoint on stop"


@pytest.mark.vllm
def test_a_vllm_self_draft_run_ends_with_every_child_exiting_on_its_own(tmp_path, model_dir):
    """``specrl run engine=vllm spec=early_exit``: the self-draft inside vLLM through the
    launcher; when the learner has its steps the actor, stopped mid-batch, leaves within the
    grace period with exit code 0 (its vLLM engine's teardown is not waited for)."""
    pytest.importorskip("vllm")
    extra = ["engine=vllm", "spec=early_exit", "run.steps=3", "actor.num_actors=1"]
    proc = launch(tmp_path, model_dir, extra)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["steps"] == 3
    assert summary["exit_codes"] == {"learner": 0, "actor-0": 0}, out[-4000:]
    assert "did not stop" not in out and "killing" not in out
    assert summary["spec_acceptance_rate"] > 0  # the self-draft drafted and was verified
    assert "stopped after" in (tmp_path / "actor-0.log").read_text()  # its loop ended


def launch_free(run_dir: Path, model_dir: Path, extra: list[str]) -> subprocess.Popen:
    return launch(run_dir, model_dir, extra, fixed_port=False)


def test_two_runs_at_once_pick_their_own_ports_and_both_complete(tmp_path, model_dir):
    runs = [tmp_path / "a", tmp_path / "b"]
    procs = [launch_free(d, model_dir, ["run.steps=4", "actor.num_actors=1"]) for d in runs]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0, out
    ports = [json.loads((d / "ports.json").read_text()) for d in runs]
    assert ports[0]["learner.address"] != ports[1]["learner.address"]
    for d in runs:
        assert json.loads((d / "summary.json").read_text())["outcome"] == "completed"


def test_a_failing_child_is_named_on_the_terminal_with_its_exception(tmp_path, model_dir):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for f in model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    proc = launch_free(tmp_path / "run", broken, ["run.steps=4", "actor.num_actors=1"])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    line = next(x for x in out.splitlines() if "exited with code" in x)
    assert "Error" in line.split("exited with code", 1)[1], line  # the exception's type...
    assert str(tmp_path / "run") in line and ".log" in line  # ...and where the log is


def test_configuration_that_cannot_work_is_refused_before_anything_starts(tmp_path, model_dir):
    odd = tmp_path / "odd-model"
    odd.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu_new"}))
    proc = launch_free(tmp_path / "run", odd, ["run.steps=4"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert f"model.path='{odd}'" in out and "hidden_act='gelu_new'" in out
    assert not (tmp_path / "run" / "learner.log").exists()

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = launch_free(
            tmp_path / "run2", model_dir, [f"learner.address=tcp://127.0.0.1:{port}"]
        )
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert f"port {port} is taken" in out


def test_no_password_on_any_command_line_nor_in_the_saved_config(tmp_path, model_dir):
    """`specrl run` against a password-protected Redis given as redis.url: while the run goes,
    no process it started (learner, actor) has the password in /proc/<pid>/cmdline, which any
    local user can read; they get it from the environment, and the run completes, so it
    reached them; runs/<name>/config.yaml shows it redacted."""
    password = "pw-" + os.urandom(8).hex()
    with RedisServer(password=password, data_dir=tmp_path / "redis") as server:
        assert password not in " ".join(server._proc.args)
        proc = launch(
            tmp_path / "run",
            model_dir,
            ["run.steps=3", "actor.num_actors=1", f"redis.url={server.url}"],
        )
        seen: dict[int, bytes] = {}
        while proc.poll() is None:
            for pid in descendants(proc.pid) - set(seen):
                try:
                    line = (Path("/proc") / str(pid) / "cmdline").read_bytes()
                except OSError:
                    continue
                if line:  # empty once it has exited (a zombie)
                    seen[pid] = line
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    modules = {m for c in seen.values() for m in (b"learner.main", b"actors.main") if m in c}
    assert modules == {b"learner.main", b"actors.main"}, seen
    leaks = {pid: c for pid, c in seen.items() if password.encode() in c}
    assert not leaks, leaks
    assert any(f"redis.url=redis://127.0.0.1:{server.port}/0".encode() in c for c in seen.values())
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert password not in saved and f"url: redis://:***@127.0.0.1:{server.port}/0" in saved


def test_the_run_directory_and_everything_in_it_are_this_users_alone(tmp_path, model_dir):
    """Under a permissive umask (002) and in a run directory made 0755 beforehand: once the run
    is over, the run directory and everything in it (config, logs, metrics, held-out
    evaluations, checkpoints, Redis' files, the report) have no group or other bits."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o755)
    extra = ["run.steps=4", "actor.num_actors=1", "eval.every=2", "eval.prompts=4"]
    extra.append(f"redis.host_cache_dir={tmp_path / 'shm'}")
    previous = os.umask(0o002)
    try:
        proc = launch(run_dir, model_dir, extra)
    finally:
        os.umask(previous)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    paths = [run_dir, *(p for p in run_dir.rglob("*") if not p.is_symlink())]
    names = {str(p.relative_to(run_dir)) for p in paths}
    assert {"config.yaml", "metrics.jsonl", "learner.log", "actor-0.log", "summary.json"} <= names
    assert any(n.startswith("eval/") for n in names) and any(
        n.startswith("checkpoints/step") for n in names
    ), names
    loose = {
        str(p.relative_to(run_dir)): oct(mode)
        for p in paths
        if (mode := stat.S_IMODE(p.lstat().st_mode)) & 0o077
    }
    assert not loose, loose
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700

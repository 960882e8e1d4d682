"""`specrl run` end to end: private Redis, learner and actors as processes, summary and plot,
and a clean stop on SIGTERM with no orphan process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.redis_server import find_free_port
from tests.integration.pipeline_harness import ROOT, warm_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model(tmp_path_factory.mktemp("model"))


def launch(run_dir: Path, model_dir: Path, extra: list[str]) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "common.cli",
        "run",
        f"run.name=launch-{run_dir.name}",
        f"run.dir={run_dir}",
        f"model.path={model_dir}",
        f"learner.address=tcp://127.0.0.1:{find_free_port()}",
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
    proc = launch(tmp_path, model_dir, ["run.steps=12", "actor.num_actors=2"])
    children = wait_for_processes(proc, 4, 60)  # redis + learner + 2 actors
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert len(children) >= 4, children
    assert not [p for p in children if alive(p)], "orphan processes left behind"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["steps"] == 12
    assert summary["final_version"] == 12
    assert (tmp_path / "report.png").stat().st_size > 10_000
    assert "report.png" in (tmp_path / "report.md").read_text()
    assert "reward_last_10pct" in out and "summary" in out
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("learner/step") == 12 for r in rows)


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

"""Helpers to run the real pipeline (learner and actors as OS processes) inside tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from common.config import load_config
from common.warm_start import warm_start
from ops.ledger import Ledger, read_ledger  # noqa: F401  (re-exported for the tests)
from ops.redis_server import find_free_port

ROOT = Path(__file__).resolve().parents[2]


def warm_model(directory: Path, task: str = "reverse", steps: int = 150) -> Path:
    """The tiny built-in model, warm-started (a few seconds)."""
    cfg = load_config([f"task={task}", f"model.init_steps={steps}"])
    warm_start(cfg, directory)
    return directory


def spawn(module: str, overrides: list[str], log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    log = log_path.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", module, *overrides],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
    )


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@dataclass
class Pipeline:
    run_dir: Path
    overrides: list[str]
    learner: subprocess.Popen | None = None
    actors: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def make(cls, run_dir: Path, redis_url: str, model_dir: Path, extra: list[str]) -> Pipeline:
        port = find_free_port()
        overrides = [
            # Unique per pipeline: tests share one Redis, and versions of a run name only grow.
            f"run.name=it-{run_dir.name}-{uuid.uuid4().hex[:8]}",
            f"run.dir={run_dir}",
            f"redis.url={redis_url}",
            f"learner.address=tcp://127.0.0.1:{port}",
            f"model.path={model_dir}",
            "run.ledger=true",
            "actor.heartbeat_interval_s=0.5",
            "learner.metrics_port=0",
            "actor.metrics_port=0",
            *extra,
        ]
        return cls(run_dir, overrides)

    @property
    def run_name(self) -> str:
        return next(o for o in self.overrides if o.startswith("run.name=")).split("=", 1)[1]

    def start_learner(self, extra: list[str] | None = None) -> subprocess.Popen:
        self.learner = spawn(
            "learner.main", [*self.overrides, *(extra or [])], self.run_dir / "learner.log"
        )
        return self.learner

    def start_actor(self, index: int, extra: list[str] | None = None) -> subprocess.Popen:
        proc = spawn(
            "actors.main",
            [*self.overrides, f"actor.index={index}", *(extra or [])],
            self.run_dir / f"actor-{index}.log",
        )
        self.actors.append(proc)
        return proc

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.run_dir / f"{name}.log"
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else ""

    def stop_all(self) -> None:
        for proc in self.actors:
            stop(proc)
        if self.learner is not None:
            stop(self.learner)

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    def steps(self) -> list[dict]:
        return [r for r in self.metrics() if "learner/reward_mean" in r]

"""The real pipeline (learner and actors as OS processes, ops/processes.py) inside tests."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from common import metric_names as mn
from common.config import load_config
from learner.prepare.warm_start import warm_start
from ops import processes
from ops.processes import ROOT, Process
from ops.redis_server import find_free_port

STOP_TIMEOUT_S = 30.0


def warm_model(directory: Path, task: str = "reverse", steps: int = 150) -> Path:
    """The tiny built-in model, warm-started (a few seconds)."""
    cfg = load_config([f"task={task}", f"model.init_steps={steps}"])
    warm_start(cfg, directory)
    return directory


def stop(proc: Process, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM ``proc`` and its exit code; TimeoutError if it had to be killed."""
    code = proc.stop(timeout_s)
    if code is None:
        raise TimeoutError(f"{proc.name} did not stop within {timeout_s:.0f} s")
    return code


def wait_exit(proc: Process, timeout_s: float, pipeline: Pipeline) -> int:
    """``proc``'s exit code, failing the test if an actor dies first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            return code
        for i, actor in enumerate(pipeline.actors):
            assert actor.poll() is None, f"actor {i} died:\n{pipeline.log_tail(f'actor-{i}')}"
        time.sleep(0.5)
    pytest.fail(f"learner did not finish in {timeout_s}s:\n{pipeline.log_tail('learner')}")


@dataclass
class Pipeline:
    run_dir: Path
    overrides: list[str]
    learner: Process | None = None
    actors: list[Process] = field(default_factory=list)

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

    def start_learner(self, extra: list[str] | None = None) -> Process:
        args = [*self.overrides, *(extra or [])]
        self.learner = processes.learner(self.run_dir, args, cwd=ROOT).start()
        return self.learner

    def start_actor(self, index: int, extra: list[str] | None = None) -> Process:
        args = [*self.overrides, *(extra or [])]
        proc = processes.actor(self.run_dir, index, args, cwd=ROOT).start()
        self.actors.append(proc)
        return proc

    def start(self, actors: int) -> Process:
        """The learner, then actors 0..``actors``-1; the learner."""
        learner = self.start_learner()
        for index in range(actors):
            self.start_actor(index)
        return learner

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.run_dir / f"{name}.log"
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else ""

    def run_to_end(self, actors: int, timeout_s: float) -> None:
        """Start the learner and ``actors`` actors, assert the learner finishes its steps and
        exits cleanly, and stop the actors (whatever happens)."""
        try:
            learner = self.start(actors)
            assert wait_exit(learner, timeout_s, self) == 0, self.log_tail("learner")
        finally:
            self.stop_all()

    def stop_all(self) -> None:
        """Actors first (they flush and record what is unacked), then the learner;
        TimeoutError, once all are down, if any had to be killed."""
        codes = processes.stop_all(self.actors, STOP_TIMEOUT_S)
        if self.learner is not None:
            codes |= processes.stop_all([self.learner], STOP_TIMEOUT_S)
        killed = [name for name, code in codes.items() if code is None]
        if killed:
            raise TimeoutError(f"{', '.join(killed)} did not stop within {STOP_TIMEOUT_S:.0f} s")

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    def steps(self) -> list[dict]:
        return [r for r in self.metrics() if mn.LEARNER_REWARD_MEAN in r]

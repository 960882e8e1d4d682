"""The processes of a running ``specrl run`` as /proc sees them: which child is the learner, an
actor or Redis, how long each one's main thread ran, waited for a core or slept, and how busy the
whole machine was (benchmarks/pipeline.py's idle and CPU figures)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import metric_names as mn

# Every learner record carries the reward: one mark per completed step in the raw file.
_STEP_MARK = f'"{mn.LEARNER_REWARD_MEAN}"'.encode()

CLK_TCK = os.sysconf("SC_CLK_TCK")


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (field 3 onwards)."""
    text = read_text(f"/proc/{pid}/stat")
    return text[text.rindex(")") + 2 :].split() if text else None


def children_of() -> dict[int, list[int]]:
    """Every live process's children, by parent pid."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        fields = _stat_fields(int(entry)) if entry.isdigit() else None
        if fields:
            out.setdefault(int(fields[1]), []).append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    children, out, todo = children_of(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _children(pid: int) -> dict[int, str]:
    """Direct children of ``pid`` and their command lines."""
    pids = children_of().get(pid, [])
    return {c: (read_text(f"/proc/{c}/cmdline") or "").replace("\0", " ") for c in pids}


def _renice(pid: int, nice: int) -> None:
    """Lower the CPU priority of every thread of ``pid`` (threads it starts later inherit it)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except (ProcessLookupError, PermissionError):
            continue


@dataclass
class ProcSample:
    run_s: float  # main thread on a CPU
    runnable_s: float  # main thread runnable, waiting for a CPU
    cpu_s: float  # all threads, user + system


def _proc_sample(pid: int) -> ProcSample | None:
    sched = read_text(f"/proc/{pid}/schedstat")
    fields = _stat_fields(pid)
    if not sched or not fields:
        return None
    run_ns, wait_ns = (int(x) for x in sched.split()[:2])
    cpu_ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ProcSample(run_ns / 1e9, wait_ns / 1e9, cpu_ticks / CLK_TCK)


def _machine_busy_s() -> float:
    """CPU-seconds the whole machine has been busy (all cores)."""
    text = read_text("/proc/stat") or ""
    values = [int(x) for x in text.splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / CLK_TCK


@dataclass
class Sample:
    t: float
    steps: int
    procs: dict[str, ProcSample]
    machine_busy_s: float


@dataclass
class Monitor:
    """Samples the launcher's children (learner, actors, Redis) and the step count."""

    launcher_pid: int
    metrics_path: Path
    num_actors: int
    actor_nice: int = 0
    roles: dict[int, str] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    _offset: int = 0
    _steps: int = 0

    def _discover(self) -> None:
        for pid, cmdline in _children(self.launcher_pid).items():
            if pid in self.roles:
                continue
            if "learner.main" in cmdline:
                self.roles[pid] = "learner"
            elif "actors.main" in cmdline:
                index = next(
                    (a.split("=", 1)[1] for a in cmdline.split() if a.startswith("actor.index=")),
                    str(len(self.roles)),
                )
                self.roles[pid] = f"actor-{index}"
                if self.actor_nice:
                    _renice(pid, self.actor_nice)
            elif "redis" in cmdline:
                self.roles[pid] = "redis"

    def _count_steps(self) -> int:
        try:
            with self.metrics_path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return self._steps
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        self._steps += complete.count(_STEP_MARK)
        return self._steps

    def sample(self) -> None:
        if len([r for r in self.roles.values() if r != "redis"]) < self.num_actors + 1:
            self._discover()
        previous = self.samples[-1].procs if self.samples else {}
        procs = {}
        for pid, role in self.roles.items():
            s = _proc_sample(pid)
            procs[role] = s if s is not None else previous.get(role, ProcSample(0, 0, 0))
        self.samples.append(Sample(time.monotonic(), self._count_steps(), procs, _machine_busy_s()))

    def window(self, total_steps: int) -> tuple[Sample, Sample] | None:
        """Samples at the first step's end and the last step's end (to sampling resolution)."""
        start = next((s for s in self.samples if s.steps >= 1), None)
        end = next((s for s in self.samples if s.steps >= total_steps), None)
        if start is None or end is None or end.t <= start.t:
            return None
        return start, end


def proc_figures(monitor: Monitor, total_steps: int, cores: int) -> dict:
    """Idle/starved shares of the actors' main threads and CPU use over the training window."""
    window = monitor.window(total_steps)
    if window is None:
        return {}
    a, b = window
    dt = b.t - a.t

    def delta(role: str) -> tuple[float, float, float]:
        pa, pb = a.procs.get(role), b.procs.get(role)
        if pa is None or pb is None:
            return 0.0, 0.0, 0.0
        return pb.run_s - pa.run_s, pb.runnable_s - pa.runnable_s, pb.cpu_s - pa.cpu_s

    actors = sorted(r for r in b.procs if r.startswith("actor-"))
    idle, starved = [], []
    for role in actors:
        run_s, runnable_s, _ = delta(role)
        idle.append(max(0.0, 1.0 - (run_s + runnable_s) / dt))
        starved.append(runnable_s / dt)
    learner_run, learner_runnable, _ = delta("learner")
    pipeline_cpu = sum(delta(r)[2] for r in b.procs)
    machine_cpu = b.machine_busy_s - a.machine_busy_s
    return {
        "actor_idle_frac": statistics.mean(idle) if idle else None,
        "actor_idle_frac_each": idle,
        "actor_cpu_starved_frac": statistics.mean(starved) if starved else None,
        "learner_main_thread_idle_frac": max(0.0, 1.0 - (learner_run + learner_runnable) / dt),
        "learner_cpu_starved_frac": learner_runnable / dt,
        "pipeline_cpu_util": pipeline_cpu / (cores * dt),
        "other_cpu_util": max(0.0, machine_cpu - pipeline_cpu) / (cores * dt),
        "proc_window_s": dt,
    }

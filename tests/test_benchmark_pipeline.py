"""benchmarks/pipeline.py and benchmarks/procstat.py: the figures derived from metrics.jsonl and
/proc samples (no runs)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.pipeline import combine, metrics_figures, moving_average
from benchmarks.procstat import Monitor, ProcSample, Sample, proc_figures


def test_moving_average_is_trailing_and_waits_for_a_full_window() -> None:
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [None, 1.5, 2.5, 3.5]
    assert moving_average([1.0], 3) == [None]


def _step(step: int, wall_s: float, reward: float) -> dict:
    return {
        "learner/step": step,
        "learner/version": step,
        "learner/reward_mean": reward,
        "learner/groups": 16,
        "learner/wall_s": wall_s,
        "learner/wait_s": 0.25,
        "learner/train_s": 0.5,
        "learner/publish_s": 0.25,
    }


def test_metrics_figures_time_from_first_step_to_target() -> None:
    rewards = [0.1, 0.2, 0.5, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    rows = [_step(i + 1, 10.0 + i, r) for i, r in enumerate(rewards)]
    rows.append({"event": "learner_exit", "learner/step": 10})
    f = metrics_figures(rows, group_size=8, target=0.7, window=2)
    assert f["steps"] == 10
    assert f["train_window_s"] == pytest.approx(9.0)
    # Steps 2..10 count: the first step's end is the start of the clock.
    assert f["samples_per_s"] == pytest.approx(9 * 16 * 8 / 9.0)
    # Moving average of 2: (0.5 + 0.9) / 2 = 0.7 at step 4, 3 s after step 1.
    assert f["steps_to_target"] == 4
    assert f["time_to_target_s"] == pytest.approx(3.0)
    # The ladder around the target: 0.6 also at step 4 ((0.2 + 0.5) / 2 < 0.6 at step 3), 0.75
    # at step 5.
    assert f["time_to_reward_0.60_s"] == pytest.approx(3.0)
    assert f["time_to_reward_0.70_s"] == f["time_to_target_s"]
    assert f["time_to_reward_0.75_s"] == pytest.approx(4.0)
    assert f["final_reward"] == pytest.approx(0.9)
    assert f["learner_idle_frac"] == pytest.approx(0.25)


def test_metrics_figures_target_not_reached() -> None:
    rows = [_step(i + 1, float(i), 0.2) for i in range(5)]
    f = metrics_figures(rows, group_size=8, target=0.7, window=2)
    assert f["time_to_target_s"] is None and f["steps_to_target"] is None


def test_proc_figures_split_run_runnable_and_idle() -> None:
    monitor = Monitor(launcher_pid=0, metrics_path=None, num_actors=1)  # type: ignore[arg-type]
    monitor.samples = [
        Sample(0.0, 0, {"learner": ProcSample(0, 0, 0), "actor-0": ProcSample(0, 0, 0)}, 0.0),
        Sample(1.0, 1, {"learner": ProcSample(0, 0, 0), "actor-0": ProcSample(0, 0, 0)}, 0.0),
        Sample(
            11.0,
            5,
            {"learner": ProcSample(8.0, 1.0, 9.0), "actor-0": ProcSample(4.0, 2.0, 5.0)},
            20.0,
        ),
    ]
    f = proc_figures(monitor, total_steps=5, cores=2)
    assert f["proc_window_s"] == pytest.approx(10.0)
    assert f["actor_idle_frac"] == pytest.approx(0.4)
    assert f["actor_cpu_starved_frac"] == pytest.approx(0.2)
    assert f["learner_main_thread_idle_frac"] == pytest.approx(0.1)
    assert f["pipeline_cpu_util"] == pytest.approx(14.0 / 20.0)
    assert f["other_cpu_util"] == pytest.approx(6.0 / 20.0)


def test_monitor_counts_only_complete_step_lines(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    monitor = Monitor(launcher_pid=os.getpid(), metrics_path=path, num_actors=1)
    with path.open("w") as f:
        f.write(json.dumps(_step(1, 0.0, 0.5)) + "\n" + '{"learner/reward_mean": 0.')
    assert monitor._count_steps() == 1
    with path.open("a") as f:
        f.write('5}\n{"event": "learner_exit"}\n')
    assert monitor._count_steps() == 2
    monitor.sample()
    assert monitor.samples[-1].steps == 2


def test_combine_takes_medians_and_no_time_if_a_repeat_missed() -> None:
    out = combine(
        [
            {"samples_per_s": 1.0, "time_to_target_s": 5.0},
            {"samples_per_s": 3.0, "time_to_target_s": None},
            {"samples_per_s": 2.0, "time_to_target_s": 7.0},
        ]
    )
    assert out["samples_per_s"] == 2.0
    assert out["time_to_target_s"] is None
    assert len(out["repeats"]) == 3

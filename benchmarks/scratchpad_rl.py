"""RL on the scratchpad task for a fixed wall time, and how its reward moves.

Runs ``specrl run task=scratchpad model=small run.steps=100000 run.max_wall_s=MINUTES*60`` in
``runs/bench/scratchpad-rl`` (or, with ``--run-dir``, reads a run that has already ended) and
writes from the run's ``metrics.jsonl``: the steps taken, the reward mean of each quarter of
the steps with its standard error (of the per-step means), reward and draft acceptance over the
first and last 10% of steps, groups trained and actor tokens/s.

    python -m benchmarks.scratchpad_rl --minutes 15 --json benchmarks/results/scratchpad_rl_15min.json
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from benchmarks import cli
from common import metric_names as mn
from ops.metrics_file import read_metrics
from ops.run_summary import step_rows, summarize

ROOT = Path(__file__).resolve().parent.parent

RUN_OVERRIDES = ["task=scratchpad", "model=small", "run.steps=100000"]
QUARTERS = 4
SUMMARY_KEYS = (
    "reward_first_10pct",
    "reward_last_10pct",
    "spec_acceptance_first_10pct",
    "spec_acceptance_last_10pct",
    "groups_trained",
    "actor_tokens_per_s",
)


def reward_by_quarter(steps: list[dict], parts: int = QUARTERS) -> list[dict]:
    """The steps cut into ``parts`` runs of consecutive steps (sizes differ by one at most):
    each one's first and last step number (1-based), the mean of its per-step reward means and
    that mean's standard error (sample standard deviation over the square root of the count)."""
    out = []
    for i in range(parts):
        lo, hi = len(steps) * i // parts, len(steps) * (i + 1) // parts
        rewards = [r[mn.LEARNER_REWARD_MEAN] for r in steps[lo:hi]]
        if not rewards:
            continue
        mean = sum(rewards) / len(rewards)
        var = sum((x - mean) ** 2 for x in rewards) / max(len(rewards) - 1, 1)
        out.append(
            {
                "steps": [lo + 1, hi],
                "reward_mean": round(mean, 4),
                "standard_error": round(math.sqrt(var / len(rewards)), 4),
            }
        )
    return out


def figures(run_dir: Path) -> dict:
    """The run's figures from ``run_dir/metrics.jsonl``; ``wall_s`` from the ``summary.json``
    that ``specrl run`` writes at its end (None without one)."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = step_rows(rows)
    if not steps:
        raise SystemExit(f"{run_dir / 'metrics.jsonl'} holds no learner steps")
    path = run_dir / "summary.json"
    wall_s = json.loads(path.read_text()).get("wall_s") if path.is_file() else None
    summary = summarize(rows, wall_s=0.0)
    out: dict = {"wall_s": wall_s, "steps": len(steps)}
    credit = _partial_credit(run_dir)
    if credit is not None:
        out["reward"] = (
            f"exact final answer 1, else {credit:g} x share of right digits "
            f"(task.partial_credit={credit:g})"
        )
    out["reward_by_quarter"] = reward_by_quarter(steps)
    out |= {k: summary[k] for k in SUMMARY_KEYS if k in summary}
    return out


def _partial_credit(run_dir: Path) -> float | None:
    """``task.partial_credit`` from the run's saved ``config.yaml``, None where it is absent."""
    import yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    task = (yaml.safe_load(path.read_text()) or {}).get("task") or {}
    value = task.get("partial_credit")
    return None if value is None else float(value)


def main() -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--minutes", type=float, default=15.0, help="the run's wall time")
    parser.add_argument("--run-dir", type=Path, help="read this finished run; start none")
    opts = parser.parse_args()
    overrides = [*RUN_OVERRIDES, f"run.max_wall_s={opts.minutes * 60:g}"]
    run_dir, info = cli.specrl_run("scratchpad-rl", overrides, opts.run_dir)
    out = figures(run_dir)
    out = {**info, "machine": f"{os.cpu_count()} CPUs, {cli.cpu_model()}", **out}
    for key, value in out.items():
        print(f"  {key}: {value}")
    return cli.finish(out, opts.json)


if __name__ == "__main__":
    sys.exit(main())

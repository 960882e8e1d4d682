"""Multi-turn episodes: the ``lookup`` environment learned by RL on the tiny char model.

Runs ``specrl run task=lookup env.name=lookup model.init_steps=STEPS run.steps=100000
run.max_wall_s=MINUTES*60`` in ``runs/bench/multiturn-lookup`` (or, with ``--run-dir``, reads a
run that has ended). The tiny model is first warm-started on lookup demonstrations whose
environment span is masked (``common/lookup.py``), for too few steps to master the tool call;
RL takes it from there, each episode's reward coming from the environment (1 when the answer
copied from the tool's output is the value). Reported from the run's ``metrics.jsonl``: steps,
the reward of the first and last 10% of the steps and their difference, the mean turns per
episode and the share of an episode's tokens the environment wrote, over the same slices.

    python -m benchmarks.multiturn --json benchmarks/results/multiturn.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from benchmarks import cli
from common import metric_names as mn
from ops.metrics_file import read_metrics
from ops.run_summary import first_last_tenth, step_rows

ROOT = Path(__file__).resolve().parent.parent

INIT_STEPS = 400
"""Warm-start steps of the tiny model: the tool call right about 4 times in 10, not mastered."""
RUN_OVERRIDES = [
    "task=lookup",
    "env.name=lookup",
    "env.max_turn_tokens=10",
    "env.max_total_tokens=100",
    "env.max_obs_tokens=32",
    "run.steps=100000",
]


def tenth_means(steps: list[dict], key: str) -> tuple[float, float]:
    """The mean of ``key`` over the first and over the last 10% of the steps that hold it."""
    return first_last_tenth([r[key] for r in steps if key in r])


def figures(run_dir: Path) -> dict:
    """The learning figures of the run in ``run_dir`` (module docstring)."""
    steps = step_rows(read_metrics(run_dir / "metrics.jsonl"))
    if not steps:
        raise SystemExit(f"{run_dir / 'metrics.jsonl'} holds no learner steps")
    path = run_dir / "summary.json"
    wall_s = json.loads(path.read_text()).get("wall_s") if path.is_file() else None
    first, last = tenth_means(steps, mn.LEARNER_REWARD_MEAN)
    turns = tenth_means(steps, mn.ENV_TURNS_MEAN)
    env_frac = tenth_means(steps, mn.ENV_TOKEN_FRAC)
    return {
        "mt_lookup_wall_s": wall_s,
        "mt_lookup_steps": len(steps),
        "mt_lookup_reward_first_10pct": round(first, 4),
        "mt_lookup_reward_last_10pct": round(last, 4),
        "mt_lookup_reward_gain": round(last - first, 4),
        "mt_lookup_turns_first_last_10pct": [round(t, 3) for t in turns],
        "mt_lookup_env_token_frac_first_last_10pct": [round(f, 3) for f in env_frac],
    }


def main() -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--minutes", type=float, default=10.0, help="the RL run's wall time")
    parser.add_argument("--init-steps", type=int, default=INIT_STEPS, help="warm-start steps")
    parser.add_argument("--run-dir", type=Path, help="read this finished run; start none")
    opts = parser.parse_args()
    overrides = [
        *RUN_OVERRIDES,
        f"model.init_steps={opts.init_steps}",
        f"run.max_wall_s={opts.minutes * 60:g}",
    ]
    run_dir, info = cli.specrl_run("multiturn-lookup", overrides, opts.run_dir)
    out = {**info, "machine": f"{os.cpu_count()} CPUs, {cli.cpu_model()}", **figures(run_dir)}
    for key, value in out.items():
        print(f"  {key}: {value}")
    return cli.finish(out, opts.json)


if __name__ == "__main__":
    sys.exit(main())

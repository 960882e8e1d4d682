"""Multi-turn episodes (design note §5.1): exactness, mechanics, speed, failure handling and
learning, on the built-in tiny char model and the ``lookup`` environment.

Sections (``--only`` a comma list; all by default), each in its own module:

- ``exact`` (``benchmarks/multiturn_exact.py``): chi-square p-values of two-turn episodes with
  the weights changing mid-turn, between turns and in turn 1, against the exact law; the
  ``keep`` and stale-history-KV controls; recorded log-probs against fresh forwards; turns the
  environment saw that verification rejected;
- ``mechanics`` and ``speed`` (``benchmarks/multiturn_rows.py``): environment positions in the
  learner's loss, re-tokenisation, the chat bridge's probe over random conversations, n-gram
  tokens per verification after the tool's output, decode idle share and turn overhead with 32
  episodes in flight and 50 ms of environment latency;
- ``chaos`` (``benchmarks/multiturn_chaos.py``): crashes, hangs, huge observations, malformed
  calls injected through worker processes, forged special tokens on chat templates, and the
  whole service for 2 minutes with a fifth of its problems faulty;
- ``learning``: ``specrl run task=lookup env.name=lookup`` for 10 minutes after a too-short
  warm start (``model.init_steps``); reward of the first and last 10% of the learner's steps,
  turns per episode and the share of tokens the environment wrote over the same slices.

Speed figures are from this machine and the load beside them (``loadavg_end``); the rest are
counts and probabilities that do not depend on it.

    python -m benchmarks.multiturn --json benchmarks/results/multiturn.json
"""

from __future__ import annotations

import json
import os
import sys
import time
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
SECTIONS = ("exact", "mechanics", "speed", "chaos", "learning")


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


def tiny_rows(sections: set[str]) -> dict:
    """The sections on the tiny model, in this process."""
    out: dict = {}
    if "exact" in sections:
        from benchmarks import multiturn_exact

        out.update(multiturn_exact.figures())
    if not sections & {"mechanics", "speed", "chaos"}:
        return out
    from benchmarks import multiturn_chaos, multiturn_rows

    cfg = multiturn_rows.lookup_config()
    model, tokenizer = multiturn_rows.lookup_model(cfg)
    out["mt_rows_model_init_steps"] = multiturn_rows.INIT_STEPS
    if "mechanics" in sections:
        out.update(multiturn_rows.mechanics_figures(model, tokenizer, cfg))
    if "speed" in sections:
        out.update(multiturn_rows.speed_figures(model, tokenizer, cfg))
    if "chaos" in sections:
        workers = 2
        result = multiturn_chaos.run_chaos(model, tokenizer, cfg, workers=workers)
        out.update(multiturn_chaos.rows(result, workers))
        out["mt_chaos_forged_special_tokens"] = multiturn_chaos.forged_special_tokens()
    return out


def main() -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--minutes", type=float, default=10.0, help="the RL run's wall time")
    parser.add_argument("--init-steps", type=int, default=INIT_STEPS, help="warm-start steps")
    parser.add_argument("--run-dir", type=Path, help="read this finished run; start none")
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}"
    )
    opts = parser.parse_args()
    sections = set(opts.only.split(","))
    unknown = sections - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    started = time.perf_counter()
    out: dict = {
        "machine": f"{os.cpu_count()} CPUs, {cli.cpu_model()}",
        "sections": sorted(sections),
    }
    out.update(tiny_rows(sections))
    if "chaos" in sections:
        from benchmarks import multiturn_chaos

        overrides = [
            *multiturn_chaos.PIPELINE_OVERRIDES,
            f"model.init_steps={opts.init_steps}",
            "run.max_wall_s=120",
        ]
        run_dir, info = cli.specrl_run("multiturn-chaos", overrides, None)
        out.update(multiturn_chaos.pipeline_figures(run_dir, info))
    if "learning" in sections:
        overrides = [
            *RUN_OVERRIDES,
            f"model.init_steps={opts.init_steps}",
            f"run.max_wall_s={opts.minutes * 60:g}",
        ]
        run_dir, info = cli.specrl_run("multiturn-lookup", overrides, opts.run_dir)
        out.update({**info, **figures(run_dir)})
    for key, value in out.items():
        print(f"  {key}: {value}")
    return cli.finish(out, opts.json, started)


if __name__ == "__main__":
    sys.exit(main())

"""Your reward, two algorithms: the real-model preset (SmolLM2-135M-Instruct) on
``task=word_problems`` with its reward written as a user function
(``examples/word_problems_reward.py``, the same scoring as the built-in), trained with
``algo=grpo`` and then ``algo=dapo`` for the same wall time each, judged by the in-training
held-out evaluation.

    python benchmarks/recipes.py [--json PATH] [--minutes 12] [--eval-every 10]
        [--eval-prompts 32] [--eval-samples 2] [--fp32]

Each run: ``specrl run model=smollm2-135m task=word_problems spec=none algo=ALGO
task.reward=examples/word_problems_reward.py:score run.max_wall_s=MINUTES*60
eval.every=EVERY eval.prompts=P eval.samples=K``. Actor 0 evaluates the held-out problems (never
in the training pool) at the version it holds when the version reaches a multiple of EVERY (and
at the start), at the preset's sampling settings; its per-problem rewards are in
``runs/<name>/eval/<actor>.jsonl``.

Figures, per algorithm: ``recipes_<algo>_eval_before`` and ``recipes_<algo>_eval_after`` (avg@K
of the first and the last evaluation, the mean reward of all held-out completions),
``recipes_<algo>_eval_gain`` with ``recipes_<algo>_eval_gain_ci95`` (the mean of per-problem
differences, a 95% normal interval over problems, paired), ``..._eval_versions`` (the versions
evaluated first and last), ``..._pass_at_k_before/_after``, ``..._groups_skipped_no_signal``
(the learner's count at the end: dynamic sampling, DAPO only), ``..._steps``,
``..._reward_by_quarter``; and ``recipes_user_reward_matches_builtin``: true when the built-in
reward (``common.dataset_task.numeric_reward``) gives every evaluated completion of both runs the
reward the user function gave it (``recipes_user_reward_compared``: how many).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALGOS = ("grpo", "dapo")
REWARD = "examples/word_problems_reward.py:score"


def evaluations(run_dir: Path) -> list[dict]:
    """Every held-out evaluation of the run, in order (from the evaluating actor's file)."""
    files = sorted((run_dir / "eval").glob("*.jsonl"))
    if not files:
        raise SystemExit(f"{run_dir}: no evaluation file (eval/*.jsonl)")
    return [json.loads(line) for line in files[0].read_text().splitlines()]


def per_problem_means(evaluation: dict) -> dict[str, float]:
    return {p["prompt_id"]: statistics.fmean(p["rewards"]) for p in evaluation["problems"]}


def paired_gain(before: dict[str, float], after: dict[str, float]) -> tuple[float, list[float]]:
    """Mean per-problem gain over the problems both evaluated, and its 95% normal interval."""
    diffs = [after[k] - before[k] for k in before if k in after]
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("inf")
    return mean, [round(mean - 1.96 * se, 4), round(mean + 1.96 * se, 4)]


def pass_at_k(evaluation: dict) -> float:
    problems = evaluation["problems"]
    return sum(any(r >= 1.0 for r in p["rewards"]) for p in problems) / len(problems)


def builtin_agreement(evals: list[dict]) -> tuple[bool, int]:
    """Whether the built-in reward gives every evaluated completion the user function's reward
    (its ``correct`` component; its weight-0 ``marked`` one adds nothing)."""
    from common.dataset_task import numeric_reward

    compared, same = 0, 0
    for evaluation in evals:
        for problem in evaluation["problems"]:
            for text, reward, failure in zip(
                problem["completions"], problem["rewards"], problem["failures"], strict=True
            ):
                compared += 1
                same += failure is None and numeric_reward(problem["answer"], text) == reward
    return compared > 0 and same == compared, compared


def one_algorithm(algo: str, args, figures: dict) -> list[dict]:
    from benchmarks.realmodel import by_quarter, metric_rows, specrl_run
    from common import metric_names as mn

    overrides = [
        "model=smollm2-135m",
        "task=word_problems",
        "spec=none",  # plain decoding: what is compared is the training, not the drafting
        f"algo={algo}",
        f"task.reward={REWARD}",
        "+task.reward_weights={marked: 0}",
        f"run.max_wall_s={int(args.minutes * 60)}",
        "run.steps=100000",
        f"eval.every={args.eval_every}",
        f"eval.prompts={args.eval_prompts}",
        f"eval.samples={args.eval_samples}",
        *(["engine.torch_dtype=float32", "learner.precision=fp32"] if args.fp32 else []),
    ]
    run_dir, _ = specrl_run(
        overrides, f"recipes-{algo}-{int(time.time())}", args.minutes * 60 + 900
    )
    evals = evaluations(run_dir)
    rows = metric_rows(run_dir)
    first, last = evals[0], evals[-1]
    before, after = per_problem_means(first), per_problem_means(last)
    gain, ci = paired_gain(before, after)
    prefix = f"recipes_{algo}"
    figures.update(
        {
            f"{prefix}_eval_before": round(statistics.fmean(before.values()), 4),
            f"{prefix}_eval_after": round(statistics.fmean(after.values()), 4),
            f"{prefix}_eval_gain": round(gain, 4),
            f"{prefix}_eval_gain_ci95": ci,
            f"{prefix}_eval_versions": [first[mn.EVAL_VERSION], last[mn.EVAL_VERSION]],
            f"{prefix}_evaluations": len(evals),
            f"{prefix}_pass_at_k_before": round(pass_at_k(first), 4),
            f"{prefix}_pass_at_k_after": round(pass_at_k(last), 4),
            f"{prefix}_groups_skipped_no_signal": int(
                rows[-1].get(mn.LEARNER_GROUPS_SKIPPED_NO_SIGNAL, 0) if rows else 0
            ),
            f"{prefix}_steps": len(rows),
            f"{prefix}_reward_by_quarter": by_quarter(rows),
            f"{prefix}_run_dir": str(run_dir.relative_to(ROOT)),
        }
    )
    print(json.dumps({k: v for k, v in figures.items() if k.startswith(prefix)}), flush=True)
    return evals


def main() -> int:
    from benchmarks import cli

    p = cli.parser(__doc__)
    p.add_argument("--minutes", type=float, default=12.0, help="wall time per algorithm (<= 20)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--eval-samples", type=int, default=2)
    p.add_argument(
        "--fp32",
        action="store_true",
        help="compute in fp32 (engine.torch_dtype=float32 learner.precision=fp32) even where "
        "the CPU has bf16 instructions (without them the run moves to fp32 by itself)",
    )
    args = p.parse_args()
    if not 0 < args.minutes <= 20:
        p.error("--minutes must be in (0, 20]")
    started = time.perf_counter()
    figures: dict = {
        "minutes_per_algorithm": args.minutes,
        "eval_every": args.eval_every,
        "eval_prompts": args.eval_prompts,
        "eval_samples": args.eval_samples,
        "reward": REWARD,
        "fp32": args.fp32,
    }
    evals = []
    for algo in ALGOS:
        evals += one_algorithm(algo, args, figures)
    matches, compared = builtin_agreement(evals)
    figures["recipes_user_reward_matches_builtin"] = matches
    figures["recipes_user_reward_compared"] = compared
    return cli.finish(figures, args.json, started)


if __name__ == "__main__":
    sys.path.insert(
        0, str(ROOT)
    )  # `python benchmarks/recipes.py` as well as `-m benchmarks.recipes`
    sys.exit(main())

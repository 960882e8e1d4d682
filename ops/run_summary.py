"""End-of-run figures from the learner's metrics JSONL (``summary.json``; ``ops.report`` draws them)."""

from __future__ import annotations

from common import metric_names as mn


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def first_last_tenth(values: list[float]) -> tuple[float, float]:
    """The mean of the first and of the last 10% of ``values`` (at least one each)."""
    tenth = max(1, len(values) // 10)
    return _mean(values[:tenth]), _mean(values[-tenth:])


def step_rows(rows: list[dict]) -> list[dict]:
    """The records of optimizer steps (not events such as ``learner_exit``)."""
    return [r for r in rows if mn.LEARNER_STEP in r and mn.LEARNER_REWARD_MEAN in r]


def learner_wall_s(steps: list[dict]) -> float:
    """Learner wall-clock over all its processes: ``learner/wall_s`` restarts at a resume."""
    total, previous = 0.0, 0.0
    for r in steps:
        wall = r.get(mn.LEARNER_WALL_S)
        if wall is None:
            continue
        if wall < previous:
            total += previous
        previous = wall
    return total + previous


def staleness_counts(steps: list[dict]) -> list[int]:
    """Trained groups per staleness 0, 1, …, summed over the steps that record
    ``learner/staleness_hist``; empty when none do."""
    counts: list[int] = []
    for r in steps:
        hist = r.get(mn.LEARNER_STALENESS_HIST) or []
        counts.extend([0] * (len(hist) - len(counts)))
        for staleness, n in enumerate(hist):
            counts[staleness] += int(n)
    return counts


def summarize(rows: list[dict], wall_s: float) -> dict:
    """Reward of the first and last 10% of steps, throughput, staleness and learner busy figures."""
    steps = step_rows(rows)
    summary: dict = {"wall_s": round(wall_s, 1), "steps": len(steps)}
    if not steps:
        return summary
    first, last = first_last_tenth([r[mn.LEARNER_REWARD_MEAN] for r in steps])
    final = steps[-1]
    learner_wall = max(learner_wall_s(steps), 1e-9)
    summary.update(
        {
            "reward_first_10pct": first,
            "reward_last_10pct": last,
            "reward_gain": last - first,
            "first_version": steps[0][mn.LEARNER_VERSION],
            "final_version": final[mn.LEARNER_VERSION],
            "groups_trained": sum(r.get(mn.LEARNER_GROUPS, 0) for r in steps),
            "groups_dropped_stale": final.get(mn.LEARNER_DROPPED_STALE, 0),
            "duplicates_dropped": final.get(mn.RECEIVER_DUPLICATES, 0),
            "bad_frames": final.get(mn.RECEIVER_BAD_FRAMES, 0),
            "staleness_mean": _mean([r.get(mn.LEARNER_STALENESS_MEAN, 0.0) for r in steps]),
            "staleness_max": max(r.get(mn.LEARNER_STALENESS_MAX, 0) for r in steps),
            "actor_tokens_per_s": _mean([r.get(mn.ACTOR_TOKENS_PER_S, 0.0) for r in steps]),
            "trained_tokens_per_s": sum(r.get(mn.LEARNER_TOKENS, 0) for r in steps) / learner_wall,
            "learner_wait_frac": sum(r.get(mn.LEARNER_WAIT_S, 0.0) for r in steps) / learner_wall,
            "learner_busy_frac": sum(
                r.get(mn.LEARNER_TRAIN_S, 0.0) + r.get(mn.LEARNER_PUBLISH_S, 0.0) for r in steps
            )
            / learner_wall,
        }
    )
    counts = staleness_counts(steps)
    if counts:
        # Exact per-group figures when the learner records them (the per-step mean is a mean of means).
        summary["staleness_hist"] = counts
        summary["staleness_mean"] = sum(s * n for s, n in enumerate(counts)) / max(sum(counts), 1)
    accepted = [
        r[mn.SPEC_ACCEPTANCE_RATE] for r in steps if r.get(mn.SPEC_ACCEPTANCE_RATE) is not None
    ]
    if accepted:
        first_a, last_a = first_last_tenth(accepted)
        lengths = [
            r[mn.SPEC_MEAN_ACCEPTED_LEN]
            for r in steps
            if r.get(mn.SPEC_MEAN_ACCEPTED_LEN) is not None
        ]
        summary.update(
            {
                "spec_acceptance_rate": _mean(accepted),
                "spec_acceptance_first_10pct": first_a,
                "spec_acceptance_last_10pct": last_a,
                "spec_mean_accepted_len": _mean(lengths),
            }
        )
    # spec=eagle3 / the adapter: the learner's own measure of the draft on each batch, taken
    # before the draft's update (the draft as the actors drafted with it).
    learner_side = [r[mn.SPEC_DRAFT_ACCEPTANCE] for r in steps if mn.SPEC_DRAFT_ACCEPTANCE in r]
    if learner_side:
        first_d, last_d = first_last_tenth(learner_side)
        summary["draft_acceptance_first_10pct"] = first_d
        summary["draft_acceptance_last_10pct"] = last_d
    salvaged = [
        r[mn.VERIFY_SALVAGED_FRAC] for r in steps if r.get(mn.VERIFY_SALVAGED_FRAC) is not None
    ]
    if salvaged:
        summary["verify_salvaged_frac"] = _mean(salvaged)
        summary["verify_steps_with_swaps"] = len(salvaged)
    return summary

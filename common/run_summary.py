"""End-of-run figures from the learner's metrics JSONL: the summary and the reward curve."""

from __future__ import annotations

from pathlib import Path


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(rows: list[dict], wall_s: float) -> dict:
    """Reward of the first and last 10% of steps, throughput and staleness figures."""
    steps = [r for r in rows if "learner/step" in r and "learner/reward_mean" in r]
    summary: dict = {"wall_s": round(wall_s, 1), "steps": len(steps)}
    if not steps:
        return summary
    tenth = max(1, len(steps) // 10)
    first = [r["learner/reward_mean"] for r in steps[:tenth]]
    last = [r["learner/reward_mean"] for r in steps[-tenth:]]
    final = steps[-1]
    summary.update(
        {
            "reward_first_10pct": _mean(first),
            "reward_last_10pct": _mean(last),
            "reward_gain": _mean(last) - _mean(first),
            "final_version": final["learner/version"],
            "groups_trained": sum(r.get("learner/groups", 0) for r in steps),
            "groups_dropped_stale": final.get("learner/dropped_stale", 0),
            "duplicates_dropped": final.get("receiver/duplicates", 0),
            "bad_frames": final.get("receiver/bad_frames", 0),
            "staleness_mean": _mean([r.get("learner/staleness_mean", 0.0) for r in steps]),
            "staleness_max": max(r.get("learner/staleness_max", 0) for r in steps),
            "actor_tokens_per_s": _mean([r.get("actor/tokens_per_s", 0.0) for r in steps]),
            "trained_tokens_per_s": sum(r.get("learner/tokens", 0) for r in steps)
            / max(final.get("learner/wall_s", 0.0), 1e-9),
            "learner_wait_frac": sum(r.get("learner/wait_s", 0.0) for r in steps)
            / max(final.get("learner/wall_s", 0.0), 1e-9),
        }
    )
    accepted = [
        r["spec/acceptance_rate"] for r in steps if r.get("spec/acceptance_rate") is not None
    ]
    if accepted:
        tenth_a = max(1, len(accepted) // 10)
        lengths = [
            r["spec/mean_accepted_len"]
            for r in steps
            if r.get("spec/mean_accepted_len") is not None
        ]
        summary.update(
            {
                "spec_acceptance_rate": _mean(accepted),
                "spec_acceptance_first_10pct": _mean(accepted[:tenth_a]),
                "spec_acceptance_last_10pct": _mean(accepted[-tenth_a:]),
                "spec_mean_accepted_len": _mean(lengths),
            }
        )
    salvaged = [
        r["verify/salvaged_frac"] for r in steps if r.get("verify/salvaged_frac") is not None
    ]
    if salvaged:
        summary["verify_salvaged_frac"] = _mean(salvaged)
        summary["verify_steps_with_swaps"] = len(salvaged)
    return summary


def plot_reward_curve(rows: list[dict], path: Path) -> bool:
    """Reward per step (and a moving average); False when there is nothing to plot."""
    steps = [r for r in rows if "learner/step" in r and "learner/reward_mean" in r]
    if not steps:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["learner/step"] for r in steps]
    y = [r["learner/reward_mean"] for r in steps]
    window = max(1, len(y) // 10)
    smooth = [_mean(y[max(0, i - window + 1) : i + 1]) for i in range(len(y))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, y, alpha=0.35, label="batch mean reward")
    ax.plot(x, smooth, linewidth=2, label=f"moving average ({window} steps)")
    ax.set_xlabel("learner step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("specrl: reward during RL")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

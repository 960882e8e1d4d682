"""``specrl report RUN_DIR``: one PNG page of curves and a short markdown of key figures.

Reads ``{RUN_DIR}/metrics.jsonl`` (the learner's records, one per step) and writes
``report.png`` (reward vs wall-clock and vs version, acceptance vs version, staleness histogram,
tokens/s, learner busy/idle) and ``report.md`` next to it. A panel whose metrics the run did not
record says "no data". ``specrl run`` writes both at the end of a run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from common import metric_names as mn
from ops.metrics_file import read_metrics
from ops.run_summary import learner_wall_s, staleness_counts, step_rows, summarize

PNG_NAME = "report.png"
MD_NAME = "report.md"


class ReportError(ValueError):
    """The run directory or its metrics cannot make a report (message says why)."""


def load_rows(run_dir: Path) -> list[dict]:
    """Every record of ``{run_dir}/metrics.jsonl``; ReportError when there are no steps."""
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{path} does not exist (not a run directory?)")
    rows = read_metrics(path)
    if not step_rows(rows):
        raise ReportError(f"{path} holds no learner steps yet")
    return rows


def write_report(
    run_dir: Path, rows: list[dict] | None = None, summary: dict | None = None
) -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.md`` in ``run_dir``; returns their paths.

    ``rows`` and ``summary`` default to what ``run_dir/metrics.jsonl`` holds (``specrl run``
    passes its own, with the outcome and its measured wall-clock).
    """
    rows = load_rows(run_dir) if rows is None else rows
    if not step_rows(rows):
        raise ReportError(f"{run_dir / 'metrics.jsonl'} holds no learner steps yet")
    if summary is None:
        summary = summarize(rows, wall_s=_wall_clock_s(rows))
        outcome = _recorded_outcome(run_dir)
        if outcome is not None:
            summary["outcome"] = outcome
    png, md = run_dir / PNG_NAME, run_dir / MD_NAME
    plot_report(rows, png, title=f"specrl run report: {run_dir.resolve().name}")
    md.write_text(render_markdown(rows, summary, run_dir.resolve().name), encoding="utf-8")
    return png, md


def _recorded_outcome(run_dir: Path) -> str | None:
    """The outcome ``specrl run`` recorded in ``summary.json``, if it did."""
    try:
        outcome = json.loads((run_dir / "summary.json").read_text(encoding="utf-8")).get("outcome")
    except (OSError, ValueError, AttributeError):
        return None  # no summary (learner started on its own) or an unreadable one
    return outcome if isinstance(outcome, str) else None


def _wall_clock_s(rows: list[dict]) -> float:
    """From the learner's start (its first record's ``elapsed_s`` back) to its last record."""
    timed = [r for r in rows if isinstance(r.get("time"), int | float)]
    if not timed:
        return 0.0
    last = max(r["time"] for r in timed)
    return last - timed[0]["time"] + float(timed[0].get("elapsed_s") or 0.0)


# --------------------------------------------------------------------------------------- plot


def _moving_average(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def _series(steps: list[dict], x_of: Callable[[dict], float], key: str) -> tuple[list, list]:
    """(x, y) of the steps where ``key`` holds a number."""
    pairs = [(x_of(r), r[key]) for r in steps if isinstance(r.get(key), int | float)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _no_data(ax, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _curve(ax, x: list, y: list, label: str, smooth: bool = True) -> None:
    """Raw values faint, their moving average (a tenth of the points) on top."""
    if not smooth or len(y) < 10:
        ax.plot(x, y, marker="." if len(y) < 50 else None, label=label)
        return
    window = max(1, len(y) // 10)
    (line,) = ax.plot(x, y, alpha=0.3)
    ax.plot(x, _moving_average(y, window), color=line.get_color(), linewidth=2, label=label)


def _version(r: dict) -> float:
    return r[mn.LEARNER_VERSION]


def plot_report(rows: list[dict], path: Path, title: str = "specrl run report") -> None:
    """One page, six panels, from the learner's metrics records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = step_rows(rows)
    timed = [r for r in rows if isinstance(r.get("time"), int | float)]
    t0 = timed[0]["time"] - float(timed[0].get("elapsed_s") or 0.0) if timed else 0.0
    span_s = max(r["time"] for r in timed) - t0 if timed else 0.0
    unit, scale = ("min", 60.0) if span_s > 600 else ("s", 1.0)
    clock_label = f"wall-clock since learner start ({unit})"

    def clock(r: dict) -> float:
        return (r.get("time", t0) - t0) / scale

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    fig.suptitle(title, fontsize=14)
    (ax_rt, ax_rv, ax_acc), (ax_st, ax_tok, ax_busy) = axes

    # Reward against wall-clock and against policy version.
    for ax, x_of, xlabel in ((ax_rt, clock, clock_label), (ax_rv, _version, "version")):
        x, y = _series(steps, x_of, mn.LEARNER_REWARD_MEAN)
        name = "reward vs " + ("wall-clock" if x_of is clock else "version")
        if not y:
            _no_data(ax, name)
            continue
        _curve(ax, x, y, "batch mean reward")
        ax.set(title=name, xlabel=xlabel, ylabel="reward")
        ax.legend(loc="lower right")

    # Draft acceptance against version (and the in-flight tokens verification kept, and the
    # share of plain steps the adaptive draft length chose).
    x, y = _series(steps, _version, mn.SPEC_ACCEPTANCE_RATE)
    xs, ys = _series(steps, _version, mn.VERIFY_SALVAGED_FRAC)
    xp, yp = _series(steps, _version, f"{mn.SPEC_DRAFT_LEN_PREFIX}k0")
    if y or ys:
        if y:
            _curve(ax_acc, x, y, "draft acceptance rate")
        if ys:
            _curve(ax_acc, xs, ys, "in-flight tokens kept (verify)")
        if yp:
            _curve(ax_acc, xp, yp, "plain steps (adaptive draft length)")
        ax_acc.set(title="acceptance vs version", xlabel="version", ylabel="fraction")
        ax_acc.set_ylim(-0.02, 1.02)
        ax_acc.legend(loc="lower right")
    else:
        _no_data(ax_acc, "acceptance vs version")

    _plot_staleness(ax_st, steps)
    _plot_throughput(ax_tok, steps, clock, clock_label)
    _plot_busy(ax_busy, steps, clock, clock_label)

    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _plot_staleness(ax_st, steps: list[dict]) -> None:
    """Staleness: per-group counts when recorded, else the per-step means."""
    counts = staleness_counts(steps)
    dropped = steps[-1].get(mn.LEARNER_DROPPED_STALE)
    dropped_text = f"; {int(dropped)} dropped as stale" if isinstance(dropped, int | float) else ""
    if counts:
        ax_st.bar(range(len(counts)), counts)
        ax_st.set(
            title=f"staleness of trained groups ({sum(counts)} groups{dropped_text})",
            xlabel="learner version − group version",
            ylabel="groups",
        )
        ax_st.set_xticks(range(len(counts)))
    else:
        _, means = _series(steps, _version, mn.LEARNER_STALENESS_MEAN)
        if means:
            ax_st.hist(means, bins=min(20, max(5, len(means) // 5)))
            ax_st.set(
                title=f"staleness: per-step means only{dropped_text}",
                xlabel="mean staleness of a step's groups",
                ylabel="steps",
            )
        else:
            _no_data(ax_st, "staleness")


def _plot_throughput(ax_tok, steps: list[dict], clock, clock_label: str) -> None:
    """Throughput: tokens generated (all actors) and trained (learner) per second."""
    x, y = _series(steps, clock, mn.ACTOR_TOKENS_PER_S)
    trained = [
        (clock(r), r[mn.LEARNER_TOKENS] / step_s)
        for r in steps
        if isinstance(r.get(mn.LEARNER_TOKENS), int | float) and (step_s := _step_s(r)) > 0
    ]
    if y or trained:
        if y:
            _curve(ax_tok, x, y, "generated (sum over actors)")
        if trained:
            _curve(ax_tok, [p[0] for p in trained], [p[1] for p in trained], "trained (learner)")
        ax_tok.set(title="tokens/s vs wall-clock", xlabel=clock_label, ylabel="tokens/s")
        ax_tok.legend(loc="best")
    else:
        _no_data(ax_tok, "tokens/s vs wall-clock")


def _plot_busy(ax_busy, steps: list[dict], clock, clock_label: str) -> None:
    """Learner busy (train + publish) and idle (waiting for groups) shares of each step."""
    busy = [
        (clock(r), (r[mn.LEARNER_TRAIN_S] + float(r.get(mn.LEARNER_PUBLISH_S) or 0.0)) / step_s)
        for r in steps
        if isinstance(r.get(mn.LEARNER_TRAIN_S), int | float) and (step_s := _step_s(r)) > 0
    ]
    if busy:
        x = [p[0] for p in busy]
        share = _moving_average([p[1] for p in busy], max(1, len(busy) // 20))
        ax_busy.stackplot(
            x, share, [1 - s for s in share], labels=["busy (train + publish)", "idle (wait)"]
        )
        busy_s = sum(
            float(r.get(mn.LEARNER_TRAIN_S) or 0.0) + float(r.get(mn.LEARNER_PUBLISH_S) or 0.0)
            for r in steps
        )
        overall = busy_s / max(learner_wall_s(steps), 1e-9)
        ax_busy.set(
            title=f"learner busy / idle ({overall:.0%} busy overall)",
            xlabel=clock_label,
            ylabel="share of step time",
        )
        ax_busy.set_ylim(0, 1)
        ax_busy.legend(loc="lower right")
    else:
        _no_data(ax_busy, "learner busy / idle")


def _step_s(r: dict) -> float:
    return sum(
        float(r.get(k) or 0.0)
        for k in (mn.LEARNER_WAIT_S, mn.LEARNER_TRAIN_S, mn.LEARNER_PUBLISH_S)
    )


# ----------------------------------------------------------------------------------- markdown


def _fmt(value: object, spec: str = ".3g") -> str:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return "n/a"
    return format(value, spec)


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h {m:02d}m {s:02d}s" if hours else f"{m}m {s:02d}s" if m else f"{s}s"


def _mean_of(steps: list[dict], key: str) -> float | None:
    values = [r[key] for r in steps if isinstance(r.get(key), int | float)]
    return sum(values) / len(values) if values else None


def _draft_length_figures(steps: list[dict]) -> list[tuple[str, str]]:
    """Tokens per verify forward and the adaptive draft length (``spec.adaptive``): the mean
    chosen k and the share of plain steps; for ``hybrid`` the share of steps per drafter."""
    figures = [
        (
            "tokens per verify forward (all rows of a step)",
            _fmt(_mean_of(steps, mn.SPEC_TOKENS_PER_VERIFY_FORWARD), ".2f"),
        ),
        (
            "adaptive draft length: mean k / plain steps",
            f"{_fmt(_mean_of(steps, mn.SPEC_MEAN_DRAFT_LEN), '.2f')} / "
            f"{_fmt(_mean_of(steps, f'{mn.SPEC_DRAFT_LEN_PREFIX}k0'), '.0%')}",
        ),
    ]
    positions = sorted(
        {k for r in steps for k in r if k.startswith(mn.SPEC_ACCEPTANCE_POS_PREFIX)},
        key=lambda k: int(k.removeprefix(mn.SPEC_ACCEPTANCE_POS_PREFIX) or 0),
    )
    if positions:
        by_position = (
            f"{k.removeprefix(mn.SPEC_ACCEPTANCE_POS_PREFIX)}: {_fmt(_mean_of(steps, k), '.2f')}"
            for k in positions
        )
        figures.append(("acceptance by draft position", ", ".join(by_position)))
    drafters = sorted(
        {k for r in steps for k in r if k.startswith(mn.SPEC_DRAFTER_PREFIX)},
        key=lambda k: k.removeprefix(mn.SPEC_DRAFTER_PREFIX),
    )
    if drafters:
        shares = (
            f"{k.removeprefix(mn.SPEC_DRAFTER_PREFIX)} {_fmt(_mean_of(steps, k), '.0%')}"
            for k in drafters
        )
        figures.append(("steps by drafter (hybrid)", ", ".join(shares)))
    return figures


def _evaluation_figures(rows: list[dict]) -> list[tuple[str, str]]:
    """The first and the last held-out evaluation (``eval.every``), when the run had any."""
    evals = [r for r in rows if mn.EVAL_VERSION in r]
    if not evals:
        return []
    first, last = evals[0], evals[-1]
    k = _fmt(last.get(mn.EVAL_K), ".0f")

    def both(key: str) -> str:
        return f"{_fmt(first.get(key), '.3f')} → {_fmt(last.get(key), '.3f')}"

    return [
        (
            f"held-out avg@{k} / pass@{k}, version {_fmt(first[mn.EVAL_VERSION], '.0f')} → "
            f"{_fmt(last[mn.EVAL_VERSION], '.0f')} ({_fmt(last.get(mn.EVAL_PROMPTS), '.0f')} prompts)",
            f"{both(mn.EVAL_AVG_REWARD)} / {both(mn.EVAL_PASS_AT_K)}",
        ),
        *(
            [
                (
                    "held-out greedy mean reward / pass",
                    f"{both(mn.EVAL_GREEDY_AVG_REWARD)} / {both(mn.EVAL_GREEDY_PASS)}",
                )
            ]
            if mn.EVAL_GREEDY_PASS in last
            else []
        ),
    ]


def render_markdown(rows: list[dict], summary: dict, name: str) -> str:
    """Key figures of a run as a markdown table, linking the PNG page."""
    steps = step_rows(rows)
    final = steps[-1]
    bad_reasons = {
        k.rsplit("/", 1)[-1]: v
        for k, v in final.items()
        if k.startswith(mn.RECEIVER_BAD_FRAMES_PREFIX) and v
    }
    bad = _fmt(summary.get("bad_frames"), ".0f")
    if bad_reasons:
        bad += " (" + ", ".join(f"{r}: {n:.0f}" for r, n in sorted(bad_reasons.items())) + ")"
    staleness = f"{_fmt(summary.get('staleness_mean'), '.2f')} (max {_fmt(summary.get('staleness_max'), '.0f')})"
    if "staleness_hist" not in summary:
        staleness += ", mean of per-step means"
    figures = [
        *([("outcome", summary["outcome"])] if "outcome" in summary else []),
        ("learner steps", str(summary.get("steps", len(steps)))),
        (
            "policy versions",
            f"{_fmt(summary.get('first_version'), '.0f')} → {_fmt(summary.get('final_version'), '.0f')}",
        ),
        ("wall-clock", _duration(float(summary.get("wall_s") or 0.0))),
        (
            "mean reward, first 10% of steps → last 10%",
            f"{_fmt(summary.get('reward_first_10pct'), '.3f')} → {_fmt(summary.get('reward_last_10pct'), '.3f')}",
        ),
        (
            "groups trained / dropped as stale / duplicates dropped",
            " / ".join(
                _fmt(summary.get(k), ".0f")
                for k in ("groups_trained", "groups_dropped_stale", "duplicates_dropped")
            ),
        ),
        ("bad frames", bad),
        ("staleness of trained groups", staleness),
        (
            "draft acceptance, first 10% of steps → last 10%",
            f"{_fmt(summary.get('spec_acceptance_first_10pct'), '.2f')} → {_fmt(summary.get('spec_acceptance_last_10pct'), '.2f')}",
        ),
        ("mean accepted length (tokens)", _fmt(summary.get("spec_mean_accepted_len"), ".2f")),
        *(
            [
                (
                    "draft acceptance on each batch before its update (learner), first 10% → last 10%",
                    f"{_fmt(summary['draft_acceptance_first_10pct'], '.3f')} → "
                    f"{_fmt(summary['draft_acceptance_last_10pct'], '.3f')}",
                )
            ]
            if "draft_acceptance_first_10pct" in summary
            else []
        ),
        *_draft_length_figures(steps),
        *_evaluation_figures(rows),
        ("in-flight tokens kept by verification", _fmt(summary.get("verify_salvaged_frac"), ".0%")),
        ("actor tokens/s (sum over actors)", _fmt(summary.get("actor_tokens_per_s"), ",.0f")),
        ("trained tokens/s (learner)", _fmt(summary.get("trained_tokens_per_s"), ",.0f")),
        (
            "learner busy (train + publish) / idle (wait)",
            f"{_fmt(summary.get('learner_busy_frac'), '.0%')} / {_fmt(summary.get('learner_wait_frac'), '.0%')}",
        ),
    ]
    lines = [
        f"# specrl run report: {name}",
        "",
        f"Curves: [{PNG_NAME}]({PNG_NAME})",
        "",
        "| figure | value |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in figures),
        "",
        f"![run report]({PNG_NAME})",
        "",
    ]
    return "\n".join(lines)

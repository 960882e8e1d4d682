"""Synchronous vs asynchronous RL through the real pipeline, side by side in one run.

    python -m benchmarks.pipeline [--quick] [--json PATH] [--steps N] [--repeats R]
                                  [--target REWARD] [--window STEPS] [--actors 2,1]
                                  [--set KEY=VALUE ...]

Each mode is one `specrl run` (`python -m ops.cli run`): a private Redis, the learner and N
actor processes, on this machine. Both modes share every setting (task, model, seed, actors,
batch sizes, learner hyper-parameters, steps budget) except the two switches:

  sync    learner.max_staleness=0 actor.wait_for_new_version=true: each actor generates one
          batch per version and idles until the learner has trained on it and published the
          next version (classic on-policy RL; learner and actors take turns).
  async   learner.max_staleness=2 actor.wait_for_new_version=false (the defaults): actors
          never wait; the learner trains on groups up to 2 versions old (delayed verification
          updates rollouts in flight when new weights arrive).

Synchronous mode needs learner.groups_per_step = actors * actor.prompts_per_batch (one batch per
actor per version). Every layout keeps the default run's learner step (16 groups x 8
completions) and sets actor.prompts_per_batch = 16 / actors, in both modes. The headline layout
is the default run's 2 actors + learner (3 processes on this 2-core machine); the full run also
compares 1 actor + learner (one process per core), and reports each mode at its faster layout.

Budget: the same number of learner steps, so both modes train on the same number of samples
(steps x 16 groups x 8 completions); wall-clock is what is measured.

Figures (from the run's metrics.jsonl, plus /proc for the processes):
  trained samples/s   completions trained per second, from the end of the first learner step to
                      the end of the last (start-up is excluded; it is the same in both modes)
  time to target      seconds from the end of the first step until the trailing moving average
                      of the batch mean reward over --window steps first reaches --target;
                      also for target -0.1, -0.05 and +0.05, since one crossing of a noisy,
                      flattening curve can move by tens of steps from run to run
  learner idle        sum(learner/wait_s) / sum(wait_s + train_s + publish_s), steps 2..N
  actor idle          share of the window each actor's main thread was asleep (neither running
                      nor runnable: waiting for a version, or for backpressure), from
                      /proc/PID/schedstat; "CPU-starved" is the share a process was runnable
                      but had no core (more busy processes than cores)
  final reward        mean batch reward over the last 10% of steps; async is "no worse" when
                      async - sync >= -2 standard errors of that difference
With --repeats R each mode runs R times, in alternating order; tables show medians.

Other benchmarks share the cores: take the lock for figures that count, e.g.
    flock /tmp/specrl-bench.lock python -m benchmarks.pipeline --json pipeline.json
Tables also show the CPU used by processes outside the pipeline during each run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import cli
from benchmarks.procstat import Monitor, proc_figures
from common import metric_names as mn
from common.config import load_config
from learner.prepare.warm_start import ensure_model
from ops.metrics_file import read_metrics
from ops.redis_server import find_free_port

ROOT = Path(__file__).resolve().parent.parent

MODES = {
    "sync": ["learner.max_staleness=0", "actor.wait_for_new_version=true"],
    "async": ["learner.max_staleness=2", "actor.wait_for_new_version=false"],
}
SWITCHES = {o.split("=", 1)[0] for overrides in MODES.values() for o in overrides}
OWN_KEYS = {
    "run.steps",
    "run.name",
    "run.dir",
    "actor.num_actors",
    "actor.prompts_per_batch",
    "learner.groups_per_step",
    "learner.address",
}
GROUPS_PER_STEP = 16  # the default run's learner step
LADDER_OFFSETS = (-0.1, -0.05, 0.0, 0.05)
SAMPLE_EVERY_S = 0.25
TARGET_SAMPLES_RATIO = 1.5
TARGET_TIME_RATIO = 1.3


# ------------------------------------------------------------------------------- one run


def moving_average(values: list[float], window: int) -> list[float | None]:
    """Trailing mean over ``window`` values; None until the window is full."""
    out: list[float | None] = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / window if i >= window - 1 else None)
    return out


def ladder(target: float) -> list[float]:
    """Reward levels around the target: how robust the time-to-target ratio is to its choice."""
    return [round(target + d, 2) for d in LADDER_OFFSETS]


def _ladder_key(level: float) -> str:
    return f"time_to_reward_{level:.2f}_s"


def metrics_figures(rows: list[dict], group_size: int, target: float, window: int) -> dict:
    steps = [r for r in rows if mn.LEARNER_STEP in r and mn.LEARNER_REWARD_MEAN in r]
    if len(steps) < 2:
        return {"steps": len(steps)}
    t0 = steps[0][mn.LEARNER_WALL_S]
    train_window_s = steps[-1][mn.LEARNER_WALL_S] - t0
    samples = sum(r[mn.LEARNER_GROUPS] for r in steps[1:]) * group_size
    rewards = [r[mn.LEARNER_REWARD_MEAN] for r in steps]
    smooth = moving_average(rewards, window)

    def first_step_at(level: float) -> int | None:
        return next((i for i, m in enumerate(smooth) if m is not None and m >= level), None)

    hit = first_step_at(target)
    times = {}
    for level in ladder(target):
        i = first_step_at(level)
        times[_ladder_key(level)] = steps[i][mn.LEARNER_WALL_S] - t0 if i is not None else None
    later = steps[1:]
    wait = sum(r[mn.LEARNER_WAIT_S] for r in later)
    busy = sum(r[mn.LEARNER_TRAIN_S] + r[mn.LEARNER_PUBLISH_S] for r in later)
    tenth = max(1, len(steps) // 10)
    return {
        "steps": len(steps),
        "train_window_s": train_window_s,
        "samples_trained": samples,
        "samples_per_s": samples / train_window_s,
        "steps_per_s": (len(steps) - 1) / train_window_s,
        "time_to_target_s": steps[hit][mn.LEARNER_WALL_S] - t0 if hit is not None else None,
        "steps_to_target": steps[hit][mn.LEARNER_STEP] if hit is not None else None,
        **times,
        "reward_first_10pct": statistics.mean(rewards[:tenth]),
        "final_reward": statistics.mean(rewards[-tenth:]),
        "final_reward_se": (
            statistics.stdev(rewards[-tenth:]) / math.sqrt(tenth) if tenth > 1 else 0.0
        ),
        "best_moving_avg_reward": max((m for m in smooth if m is not None), default=None),
        "learner_idle_frac": wait / max(wait + busy, 1e-9),
        "learner_wait_s_per_step": wait / len(later),
        "learner_train_s_per_step": sum(r[mn.LEARNER_TRAIN_S] for r in later) / len(later),
        "learner_publish_s_per_step": sum(r[mn.LEARNER_PUBLISH_S] for r in later) / len(later),
        "staleness_mean": statistics.mean(r.get(mn.LEARNER_STALENESS_MEAN, 0.0) for r in steps),
        "groups_dropped_stale": steps[-1].get(mn.LEARNER_DROPPED_STALE, 0),
        "actor_tokens_per_s": statistics.mean(r.get(mn.ACTOR_TOKENS_PER_S, 0.0) for r in later),
        "spec_acceptance_rate": statistics.mean(r.get(mn.SPEC_ACCEPTANCE_RATE, 0.0) for r in later),
    }


def run_mode(
    mode: str,
    repeat: int,
    actors: int,
    shared: list[str],
    opts: argparse.Namespace,
    cores: int,
    out_root: Path,
) -> dict:
    run_dir = out_root / f"{mode}-{repeat}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    overrides = [
        *shared,
        *MODES[mode],
        f"run.name=bench-pipeline-{mode}-{repeat}-{os.getpid()}",
        f"run.dir={run_dir}",
        f"learner.address=tcp://127.0.0.1:{find_free_port()}",
    ]
    cmd = [sys.executable, "-m", "ops.cli", "run", *overrides]
    log_path = run_dir.parent / f"{run_dir.name}.log"
    print(f"[{mode} #{repeat + 1}] specrl run ... ({log_path})", flush=True)
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        monitor = Monitor(proc.pid, run_dir / "metrics.jsonl", actors, opts.actor_nice)
        try:
            while proc.poll() is None:
                monitor.sample()
                time.sleep(SAMPLE_EVERY_S)
        finally:
            if proc.poll() is None:  # interrupted: the launcher stops its own children
                proc.terminate()
                proc.wait()
    wall_s = time.monotonic() - started
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    outcome = summary.get("outcome", f"exit code {proc.returncode}")
    if proc.returncode != 0 or outcome != "completed":
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{mode} run failed ({outcome}); {log_path}:\n" + "\n".join(tail))
    figures = metrics_figures(
        read_metrics(run_dir / "metrics.jsonl"), opts.group_size, opts.target, opts.window
    )
    figures.update(proc_figures(monitor, opts.steps, cores))
    figures["command_wall_s"] = wall_s
    figures["run_dir"] = str(run_dir)
    figures["command"] = " ".join(["python", "-m", "ops.cli", "run", *overrides])
    t = figures.get("time_to_target_s")
    idle = figures.get("actor_idle_frac")
    print(
        f"  {figures['samples_per_s']:.0f} samples/s, "
        f"target {f'{t:.1f} s' if t is not None else 'not reached'}, "
        f"final reward {figures['final_reward']:.3f}, "
        f"learner idle {figures['learner_idle_frac']:.2f}, "
        f"actor idle {_fmt(idle, '.2f')}, "
        f"other CPU {figures.get('other_cpu_util') or 0:.2f} ({wall_s:.0f} s)",
        flush=True,
    )
    return figures


# ---------------------------------------------------------------------------- report


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    if not present or len(present) < len(values):
        return None  # a repeat that missed the target: no honest median time
    return statistics.median(present)


def combine(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float) or v is None]
    out = {k: _median([r.get(k) for r in runs]) for k in keys}
    out["repeats"] = runs
    return out


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


TABLE = [
    ("trained samples/s", "samples_per_s", ",.0f", "higher"),
    ("learner steps/s", "steps_per_s", ".2f", "higher"),
    ("time to target (s)", "time_to_target_s", ".1f", "lower"),
    ("steps to target", "steps_to_target", ".0f", "lower"),
    ("final reward (last 10%)", "final_reward", ".3f", "higher"),
    ("reward (first 10%)", "reward_first_10pct", ".3f", None),
    ("learner idle frac", "learner_idle_frac", ".3f", None),
    ("learner train s/step", "learner_train_s_per_step", ".4f", None),
    ("learner wait s/step", "learner_wait_s_per_step", ".4f", None),
    ("actor idle frac (/proc)", "actor_idle_frac", ".3f", None),
    ("actor CPU-starved frac", "actor_cpu_starved_frac", ".3f", None),
    ("learner CPU-starved frac", "learner_cpu_starved_frac", ".3f", None),
    ("pipeline CPU use (of cores)", "pipeline_cpu_util", ".2f", None),
    ("other processes' CPU use", "other_cpu_util", ".2f", None),
    ("staleness mean", "staleness_mean", ".2f", None),
    ("groups dropped as stale", "groups_dropped_stale", ".0f", None),
    ("actor tokens/s (sum)", "actor_tokens_per_s", ",.0f", None),
    ("draft acceptance", "spec_acceptance_rate", ".2f", None),
    ("training window (s)", "train_window_s", ".1f", None),
    ("whole command (s)", "command_wall_s", ".1f", None),
]


def print_table(per_mode: dict[str, dict], target: float) -> None:
    sync, asyn = per_mode["sync"], per_mode["async"]
    rows = [("figure", "sync", "async", "async vs sync")]
    table = list(TABLE)
    table[4:4] = [
        (f"time to reward {level:.2f} (s)", _ladder_key(level), ".1f", "lower")
        for level in ladder(target)
        if abs(level - target) > 1e-9
    ]
    for label, key, spec, better in table:
        s, a = sync.get(key), asyn.get(key)
        if better == "higher":
            ratio = _fmt(_ratio(a, s), ".2f") + "x"
        elif better == "lower":
            ratio = _fmt(_ratio(s, a), ".2f") + "x (sync/async)"
        else:
            ratio = ""
        rows.append((label, _fmt(s, spec), _fmt(a, spec), ratio))
    print()
    print(cli.table(rows[0], rows[1:]))


def machine_info() -> dict:
    import torch

    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu_model": cli.cpu_model() or "unknown",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def compare(
    actors: int, opts: argparse.Namespace, base: list[str], machine: dict, out_root: Path
) -> dict:
    """Both modes with ``actors`` actor processes; figures, ratios and the targets' verdicts."""
    shared = [
        *base,
        f"actor.num_actors={actors}",
        f"learner.groups_per_step={GROUPS_PER_STEP}",
        f"actor.prompts_per_batch={GROUPS_PER_STEP // actors}",
    ]
    print(
        f"\n== {actors} actor(s) + learner: {opts.steps} steps x {GROUPS_PER_STEP} groups x "
        f"{opts.group_size} completions per run, {GROUPS_PER_STEP // actors} prompts per actor "
        f"batch; {opts.repeats} repeat(s) per mode",
        flush=True,
    )
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for repeat in range(opts.repeats):
        # Alternate the order so that drift in the machine's load favours neither mode.
        order = ("sync", "async") if repeat % 2 == 0 else ("async", "sync")
        for mode in order:
            runs[mode].append(
                run_mode(
                    mode,
                    repeat,
                    actors,
                    shared,
                    opts,
                    machine["cores_usable"],
                    out_root / f"actors-{actors}",
                )
            )
    per_mode = {mode: combine(r) for mode, r in runs.items()}
    print_table(per_mode, opts.target)
    sync, asyn = per_mode["sync"], per_mode["async"]
    samples_ratio = _ratio(asyn["samples_per_s"], sync["samples_per_s"])
    time_ratio = _ratio(sync["time_to_target_s"], asyn["time_to_target_s"])
    reward_diff = asyn["final_reward"] - sync["final_reward"]
    # Standard error of the difference of the two final rewards (each: over the last 10% of
    # steps, then over the repeats): "no worse" allows what sampling noise alone explains.
    reward_diff_se = math.sqrt(
        sum(r["final_reward_se"] ** 2 for rs in runs.values() for r in rs) / opts.repeats**2
    )
    met = {
        "async_over_sync_samples_per_s": samples_ratio is not None
        and samples_ratio >= TARGET_SAMPLES_RATIO,
        "async_over_sync_time_to_target": time_ratio is not None
        and time_ratio >= TARGET_TIME_RATIO,
        "async_final_reward_no_worse": reward_diff >= -2 * reward_diff_se,
    }
    print(
        f"\nasync_over_sync_samples_per_s = {_fmt(samples_ratio, '.2f')} "
        f"(target >= {TARGET_SAMPLES_RATIO})\n"
        f"async_over_sync_time_to_target = {_fmt(time_ratio, '.2f')} (sync time / async time "
        f"to a {opts.window}-step mean reward of {opts.target}; target >= {TARGET_TIME_RATIO})\n"
        f"final reward async - sync = {reward_diff:+.3f} (standard error {reward_diff_se:.3f}; "
        f"'no worse' = above -2 standard errors)\n"
        f"targets met: {met}",
        flush=True,
    )
    return {
        "async_over_sync_samples_per_s": samples_ratio,
        "async_over_sync_time_to_target": time_ratio,
        "async_over_sync_time_to_reward": {
            f"{level:.2f}": _ratio(sync[_ladder_key(level)], asyn[_ladder_key(level)])
            for level in ladder(opts.target)
        },
        "async_final_reward_minus_sync": reward_diff,
        "final_reward_diff_se": reward_diff_se,
        "targets_met": met,
        "actors": actors,
        "shared_overrides": shared,
        "sync": sync,
        "async": asyn,
    }


def parse_options() -> tuple[argparse.Namespace, list[int]]:
    """The command line, with the --quick defaults filled in; the actor counts to compare."""
    parser = cli.parser(__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="120 steps, one repeat, 2 actors only (~2 min)"
    )
    parser.add_argument(
        "--steps", type=int, default=0, help="learner steps per run (400; quick 120)"
    )
    parser.add_argument("--repeats", type=int, default=0, help="runs per mode (2; quick 1)")
    parser.add_argument(
        "--target",
        type=float,
        default=0.0,
        help="reward target of the moving average (0.7; quick 0.55)",
    )
    parser.add_argument("--window", type=int, default=20, help="moving-average window in steps")
    parser.add_argument(
        "--actors",
        default="",
        help="comma-separated actor counts, each compared in both modes; the first gives the "
        "headline figures (2,1; quick 2)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra override for both modes (repeatable), e.g. --set run.torch_threads=2",
    )
    parser.add_argument(
        "--actor-nice",
        type=int,
        default=0,
        help="investigation: renice the actor processes (both modes) so the learner wins a core",
    )
    opts = parser.parse_args()
    for override in opts.set:
        if override.split("=", 1)[0] in SWITCHES | OWN_KEYS:
            parser.error(f"--set {override}: this benchmark sets that key (see --actors, --steps)")
    opts.steps = opts.steps or (120 if opts.quick else 400)
    opts.repeats = opts.repeats or (1 if opts.quick else 2)
    opts.target = opts.target or (0.55 if opts.quick else 0.7)
    layouts = [int(a) for a in (opts.actors or ("2" if opts.quick else "2,1")).split(",")]
    for actors in layouts:
        if actors < 1 or GROUPS_PER_STEP % actors:
            parser.error(f"--actors: each count must divide {GROUPS_PER_STEP} (groups per step)")
    return opts, layouts


def report(results: list[dict], opts: argparse.Namespace, machine: dict, seconds: float) -> int:
    """Print the headline figures and write the JSON (the first layout's figures at the top)."""
    head = results[0]
    print(f"\nheadline ({head['actors']} actors, the default run's layout when 2):")
    print(
        f"  async_over_sync_samples_per_s  = {_fmt(head['async_over_sync_samples_per_s'], '.2f')}"
    )
    print(
        f"  async_over_sync_time_to_target = {_fmt(head['async_over_sync_time_to_target'], '.2f')}"
    )
    best = {mode: max(results, key=lambda r, m=mode: r[m]["samples_per_s"]) for mode in MODES}
    best_ratio = _ratio(
        best["async"]["async"]["samples_per_s"], best["sync"]["sync"]["samples_per_s"]
    )
    if len(results) > 1:
        print(
            f"  each mode at its best layout: async ({best['async']['actors']} actors) / sync "
            f"({best['sync']['actors']} actors) samples/s = {_fmt(best_ratio, '.2f')}"
        )
    noisy = [
        r
        for res in results
        for mode in MODES
        for r in res[mode]["repeats"]
        if (r.get("other_cpu_util") or 0.0) > 0.1
    ]
    if noisy:
        print(
            f"warning: in {len(noisy)} run(s) other processes used over 10% of the CPU; "
            "those figures are noisy"
        )
    print(f"{seconds:.0f} s")

    if opts.json:
        result = {
            **{k: v for k, v in head.items() if k not in ("sync", "async")},
            "sync": head["sync"],
            "async": head["async"],
            "targets": {
                "async_over_sync_samples_per_s": TARGET_SAMPLES_RATIO,
                "async_over_sync_time_to_target": TARGET_TIME_RATIO,
            },
            "reward_target": opts.target,
            "reward_window_steps": opts.window,
            "budget": (
                f"{opts.steps} learner steps per run = "
                f"{opts.steps * GROUPS_PER_STEP * opts.group_size} trained completions"
            ),
            "mode_overrides": MODES,
            "actor_nice": opts.actor_nice,
            "layouts": {f"{r['actors']}_actors": r for r in results},
            "best_layout_async_over_best_layout_sync_samples_per_s": best_ratio,
            "machine": machine,
            "quick": opts.quick,
            "seconds": round(seconds, 1),
        }
        cli.write_json(result, opts.json)
        print(f"wrote {opts.json}")
    return 0


def main() -> int:
    opts, layouts = parse_options()
    started = time.monotonic()

    os.chdir(ROOT)  # the built-in model cache (runs/models) is relative to the repository
    base = [
        f"run.steps={opts.steps}",
        "run.seed=0",
        # Off in both: fixed Prometheus ports would collide with other runs on this machine.
        "learner.metrics_port=-1",
        "actor.metrics_port=-1",
        *opts.set,
    ]
    cfg = load_config(base)
    opts.group_size = cfg.actor.group_size
    print("model: warm start (cached after the first use) ...", flush=True)
    base.append(f"model.path={ensure_model(cfg).resolve()}")
    machine = machine_info()
    print(
        f"{machine['cpu_model']}, {machine['cores_usable']} cores; reward target "
        f"{opts.target} ({opts.window}-step moving average)",
        flush=True,
    )
    out_root = ROOT / "runs" / "bench" / "pipeline"
    results = [compare(a, opts, base, machine, out_root) for a in layouts]
    return report(results, opts, machine, time.monotonic() - started)


if __name__ == "__main__":
    sys.exit(main())

"""``specrl run``: the embedded default — private Redis, learner and N actors as OS processes.

Phases: make sure the model exists (warm start with a progress bar) → start Redis (unless
``redis.url`` is given) → spawn the learner, then the actors → show live progress from the
learner's metrics file → stop everything → write the summary and the report (``report.png``,
``report.md``).
Ctrl-C/SIGTERM stops the children cleanly (SIGTERM, then SIGKILL after a grace period); each child
also gets the kernel's parent-death signal, so not even a SIGKILL of the launcher leaves orphans.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from common.config import SpecRLConfig, to_yaml
from common.metrics import read_metrics
from common.redis_server import RedisServer, child_preexec
from common.report import write_report
from common.run_summary import summarize
from common.warm_start import default_model_dir, ensure_model

log = logging.getLogger(__name__)

STOP_GRACE_S = 20.0


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_file: IO[bytes]


@dataclass
class Launch:
    children: list[Child] = field(default_factory=list)
    redis: RedisServer | None = None


def _spawn(name: str, module: str, args: list[str], run_dir: Path) -> Child:
    log_file = (run_dir / f"{name}.log").open("ab")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=child_preexec(),
    )
    return Child(name, proc, log_file)


def _stop_children(children: list[Child], grace_s: float = STOP_GRACE_S) -> None:
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs; killing it", child.name, grace_s)
            child.proc.kill()
            child.proc.wait()
        child.log_file.close()


def child_overrides(
    cfg: SpecRLConfig, overrides: list[str], redis_url: str, model_dir: Path
) -> list[str]:
    """The user's overrides plus what the launcher decided (run name/dir, Redis URL, model)."""
    return [
        *overrides,
        f"run.name={cfg.run.name}",
        f"run.dir={cfg.run.resolved_dir()}",
        f"redis.url={redis_url}",
        f"model.path={model_dir}",
    ]


def run(cfg: SpecRLConfig, overrides: list[str], console: Console | None = None) -> dict:
    console = console or Console()
    run_dir = cfg.run.resolved_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    console.print(
        f"[bold]specrl run[/bold] {cfg.run.name}: task={cfg.task.name} actors={cfg.actor.num_actors} steps={cfg.run.steps} → {run_dir}"
    )

    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    launch = Launch()
    started = time.monotonic()
    try:
        model_dir = _prepare_model(cfg, console)
        if cfg.redis.url:
            redis_url = cfg.redis.url
        else:
            launch.redis = RedisServer(password=secrets.token_hex(16), data_dir=run_dir / "redis")
            launch.redis.start()
            redis_url = launch.redis.url
            console.print(
                f"private Redis on port {launch.redis.url.rsplit(':', 1)[-1].split('/')[0]}"
            )
        args = child_overrides(cfg, overrides, redis_url, model_dir)
        launch.children.append(_spawn("learner", "learner.main", args, run_dir))
        for i in range(cfg.actor.num_actors):
            launch.children.append(
                _spawn(f"actor-{i}", "actors.main", [*args, f"actor.index={i}"], run_dir)
            )
        outcome = _follow(cfg, launch, run_dir, console, stop)
    finally:
        _stop_children(launch.children)
        if launch.redis is not None:
            launch.redis.close()
        for s, handler in previous.items():
            signal.signal(s, handler)

    rows = read_metrics(run_dir / "metrics.jsonl")
    summary = summarize(rows, wall_s=time.monotonic() - started)
    summary["outcome"] = outcome
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if summary["steps"]:
        png, md = write_report(run_dir, rows, summary)
        summary["report"] = f"{md} ({png.name})"
    _print_summary(console, summary, run_dir)
    return summary


def _prepare_model(cfg: SpecRLConfig, console: Console) -> Path:
    if cfg.model.path or (default_model_dir(cfg) / "config.json").is_file():
        path = ensure_model(cfg)
        console.print(f"model: {path}")
        return path
    with Progress(
        TextColumn("warm start"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task_id = progress.add_task("init", total=cfg.model.init_steps, loss=float("nan"))

        def on_step(step: int, total: int, loss: float) -> None:
            progress.update(task_id, completed=step, loss=loss)

        return ensure_model(cfg, on_step)


def _follow(cfg: SpecRLConfig, launch: Launch, run_dir: Path, console: Console, stop: dict) -> str:
    """Show progress until the learner exits, a child fails, or a signal arrives."""
    learner = launch.children[0]
    metrics_path = run_dir / "metrics.jsonl"
    last_plain = 0.0
    with Progress(
        TextColumn("[bold]RL"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[line]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task_id = progress.add_task("rl", total=cfg.run.steps, line="waiting for actors…")
        while True:
            if stop["signal"]:
                console.print(f"signal {stop['signal']}: stopping learner and actors")
                return "interrupted"
            code = learner.proc.poll()
            rows = [
                r for r in read_metrics(metrics_path) if "learner/step" in r and "event" not in r
            ]
            if rows:
                last = rows[-1]
                line = _progress_line(rows)
                progress.update(task_id, completed=last["learner/step"], line=line)
                if not console.is_terminal and time.monotonic() - last_plain > 10:
                    console.print(f"step {last['learner/step']}/{cfg.run.steps} {line}")
                    last_plain = time.monotonic()
            if code is not None:
                return (
                    "completed"
                    if code == 0
                    else f"learner exited with code {code} (see {run_dir}/learner.log)"
                )
            for child in launch.children[1:]:
                if child.proc.poll() is not None and child.proc.returncode != 0:
                    return f"{child.name} exited with code {child.proc.returncode} (see {run_dir}/{child.name}.log)"
            time.sleep(0.5)


def _progress_line(rows: list[dict]) -> str:
    last = rows[-1]
    window = rows[-10:]
    reward = sum(r.get("learner/reward_mean", 0.0) for r in window) / len(window)
    line = (
        f"v{last['learner/version']} reward {reward:.3f} "
        f"tok/s {last.get('actor/tokens_per_s', 0):.0f} "
        f"stale {last.get('learner/staleness_mean', 0):.2f} "
        f"actors {last.get('actor/live', 0)}"
    )
    if last.get("spec/acceptance_rate") is not None:
        line += f" accept {last['spec/acceptance_rate']:.2f}"
    return line


def _print_summary(console: Console, summary: dict, run_dir: Path) -> None:
    console.print("[bold]summary[/bold]")
    for key, value in summary.items():
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        console.print(f"  {key:<34} {text}")
    console.print(f"metrics: {run_dir / 'metrics.jsonl'}")

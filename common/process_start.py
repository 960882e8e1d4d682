"""What a process does with its config before it runs: gather the facts of its machine, call
the resolve step once (``common/config/resolve.py``), log what changed and why, switch TF32 on
when ``run.tf32``, and save the config it runs with beside the one the user asked for
(``runs/<name>/resolved/<process>.yaml``; ``specrl run`` writes ``runs/<name>/config.yaml``).

An actor resolves in :func:`common.entrypoint.run_main`, before it runs. The learner resolves
once it knows its memory (``learner/wiring.py`` ``setup``: after the model directory exists and,
under FSDP, the ranks have agreed on the least memory among them); its entry point only
:func:`remember` s the command line. When the process ends, :func:`check_saved` compares the
config it ran with against the saved one and logs an error if anything changed it after the
resolve step.

Facts read here: the CUDA device (the learner's local rank, the actor's ``actor.device``),
whether the CPU has bf16 matrix units (``common/cpu_precision.py``), and, only on CUDA with a
real model and ``run.gpu_profile``, the model's ``config.json``/``generation_config.json`` and the
task's longest prompt. Without CUDA nothing of the model is read.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import socket
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from common import cpu_precision
from common.config import SpecRLConfig, redacted_yaml
from common.config.gpu_profile import Devices, TaskFacts, set_keys
from common.config.resolve import ROLE_SECTIONS, Facts, MemoryFacts, Resolution, Role, resolve

log = logging.getLogger(__name__)

LONGEST_PROMPTS = 512
"""Prompts tokenized to find the longest: a data set's longest by characters, or this many of a
generated task's (their longest then gets :data:`SAMPLED_MARGIN` on top)."""
SAMPLED_MARGIN = 1.25
"""Room over the longest of a sample of a generated task's prompts."""
DEPLOYMENT_RECIPE = (
    "python3 scripts/compose_gpu.py --gpus N --learner-gpus K --model-dir /models/YOUR_MODEL "
    "[--data-file FILE], then docker compose -f docker-compose.yml -f docker-compose.gpu.yml "
    "up --build (docs/deployment.md, 'Eight GPUs'); outside Docker: model.path=HF_DIR"
)
CPU_BF16_ENV = "SPECRL_CPU_BF16"
"""``fast`` or ``slow``: take this as the CPU's bf16 speed instead of asking oneDNN (to run as a
machine without AVX512-BF16/AMX would, or to test the precision layer on one that has them)."""
RESOLVED_DIR = "resolved"
"""Folder of the run directory holding each process's resolved config."""

_command_line: list[str] | None = None
_saved: set[Path] = set()
"""The resolved configs this process wrote (what :func:`check_saved` checks)."""


def remember(overrides: Sequence[str]) -> None:
    """Keep this process's command line for a resolve step that runs later (the learner's)."""
    global _command_line
    _command_line = list(overrides)


def prepare(
    cfg: SpecRLConfig,
    overrides: Sequence[str] | None,
    role: Role,
    memory: MemoryFacts | None = None,
) -> Resolution:
    """Resolve ``cfg`` for ``role`` (in place: every holder of ``cfg`` sees the resolved values),
    log the changes (rank 0 under torchrun), switch TF32 on when ``run.tf32`` and save the
    resolved config. ``overrides`` None: the command line :func:`remember` kept (none if none).
    Raises what :func:`~common.config.resolve.resolve` raises."""
    named = overrides if overrides is not None else (_command_line or [])
    facts = gather_facts(cfg, role, memory)
    if facts.devices.cuda and not cfg.model.path and role == "learner":
        log.warning("%s", tiny_model_warning(cfg, facts.devices))
    resolution = resolve(cfg, facts, named)
    set_keys(cfg, resolution.changed())
    if os.environ.get("RANK", "0") == "0":
        if resolution.profile is not None:
            log.info("%s", resolution.profile.table(ROLE_SECTIONS[role]))
        for note in resolution.notes:
            log.info("%s", note)
        if resolution.changes:
            log.info("%s", resolution.table())
        for warning in resolution.warnings:
            log.warning("GPU profile: %s", warning)
        save_resolved(cfg, resolution, role)
    if cfg.run.tf32 and facts.devices.cuda:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return resolution


def gather_facts(cfg: SpecRLConfig, role: Role, memory: MemoryFacts | None = None) -> Facts:
    """The facts :func:`~common.config.resolve.resolve` needs, measured on this machine."""
    devices = describe_devices(cfg, role)
    facts = Facts(role=role, devices=devices, memory=memory)
    if not devices.cuda:
        return replace(facts, bf16_fast=cpu_bf16_fast())
    if not (cfg.model.path and cfg.run.gpu_profile):
        return facts
    model_dir = Path(cfg.model.path)
    model_config = read_json(model_dir / "config.json")
    if model_config is None or "hidden_size" not in model_config:
        log.info("GPU profile: no usable config.json in %s; the defaults stay", model_dir)
        return facts
    return replace(
        facts,
        model_config=model_config,
        generation_config=read_json(model_dir / "generation_config.json"),
        task=task_facts(cfg, model_dir),
    )


def cpu_bf16_fast() -> bool:
    """Whether this CPU computes bf16 fast: :data:`CPU_BF16_ENV` when set, else oneDNN's check."""
    told = os.environ.get(CPU_BF16_ENV, "").strip().lower()
    if told in ("fast", "slow"):
        return told == "fast"
    if told:
        raise ValueError(f"{CPU_BF16_ENV}={told!r}: expected 'fast' or 'slow' (or unset)")
    import torch

    return cpu_precision.bf16_is_fast(torch.device("cpu"))


def process_name(cfg: SpecRLConfig, role: Role) -> str:
    """``learner``, or ``actor-<id>`` (``actor.actor_id``, else ``{hostname}-{index}``)."""
    if role == "learner":
        return "learner"
    ident = cfg.actor.actor_id or f"{socket.gethostname()}-{cfg.actor.index}"
    return "actor-" + re.sub(r"[^A-Za-z0-9_.-]", "_", ident)


def resolved_path(cfg: SpecRLConfig, role: Role) -> Path:
    return cfg.run.resolved_dir() / RESOLVED_DIR / f"{process_name(cfg, role)}.yaml"


def save_resolved(cfg: SpecRLConfig, resolution: Resolution, role: Role) -> Path:
    """Write the resolved config (redacted, as ``config.yaml`` is), headed by the table of what
    the resolve step changed, to :func:`resolved_path`."""
    path = resolved_path(cfg, role)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "".join(f"# {line}\n" for line in resolution.table().splitlines())
    path.write_text(header + redacted_yaml(cfg))
    _saved.add(path.resolve())
    return path


def saved_config(path: Path) -> str:
    """The YAML body of a saved resolved config (without its header)."""
    return "".join(line for line in path.read_text().splitlines(True) if not line.startswith("#"))


def check_saved(cfg: SpecRLConfig, role: Role) -> bool:
    """At the end of the process: True when ``cfg`` still equals the resolved config this
    process saved (or it saved none: a follower rank); else log an error naming the lines that
    differ."""
    path = resolved_path(cfg, role)
    if path.resolve() not in _saved or not path.is_file():
        return True
    saved, ran = saved_config(path), redacted_yaml(cfg)
    if saved == ran:
        log.info("ran with the resolved config saved in %s", path)
        return True
    differ = [a for a, b in zip(saved.splitlines(), ran.splitlines(), strict=False) if a != b]
    log.error(
        "the config this process ran with differs from %s, saved by the resolve step: %s",
        path,
        "; ".join(differ[:8]) or "a different number of lines",
    )
    return False


def describe_devices(cfg: SpecRLConfig, role: Role) -> Devices:
    """The CUDA device this process uses (the learner's local rank, the actor's
    ``actor.device``), or ``Devices(cuda=False)``."""
    if role == "actor" and not cfg.actor.device.startswith("cuda"):
        return Devices(cuda=False)
    import torch

    if not torch.cuda.is_available():
        return Devices(cuda=False)
    if role == "actor":
        index = torch.device(cfg.actor.device).index or 0
    else:
        index = int(os.environ.get("LOCAL_RANK", "0"))
    props = torch.cuda.get_device_properties(index)
    return Devices(
        cuda=True,
        count=torch.cuda.device_count(),
        name=props.name,
        memory_gib=props.total_memory / 2**30,
        capability=(props.major, props.minor),
    )


def tiny_model_warning(cfg: SpecRLConfig, devices: Devices) -> str:
    """What a GPU node runs without a model directory, and how to run a real model."""
    return (
        f"GPU node ({devices.describe()}) running the built-in tiny model "
        f"(model.hidden_size={cfg.model.hidden_size}, {cfg.model.num_layers} layers, "
        f"task={cfg.task.name}) on the {cfg.engine.name} engine and one GPU: a demo of the "
        "pipeline, not a model worth training (plain `docker compose up` puts the learner and "
        "one actor on GPU 0 and leaves any other GPU idle). To train a real model: "
        f"{DEPLOYMENT_RECIPE}"
    )


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or None when it is missing."""
    return json.loads(path.read_text()) if path.is_file() else None


def task_facts(cfg: SpecRLConfig, model_dir: Path) -> TaskFacts:
    """The longest prompt of the task in tokens as the actors encode it (the task's declared
    ``max_prompt_tokens`` when it has one), and its ``max_new_tokens``; prompt length 0 when
    the task or tokenizer cannot be loaded here (logged)."""
    from common.prompts import prompt_encoder
    from common.tasks import task_from_config
    from common.tokenizer import load_tokenizer

    try:
        task = task_from_config(cfg.task)
        declared = int(getattr(task, "max_prompt_tokens", 0) or 0)
        if declared:
            return TaskFacts(declared, task.max_new_tokens, "declared by the task")
        tokenizer = load_tokenizer(model_dir)
        encode = prompt_encoder(
            tokenizer,
            cfg.task.chat_template,
            cfg.task.system_prompt,
            dataset=cfg.task.natural_language,
        )
    except (OSError, ValueError, ImportError) as e:
        log.warning("GPU profile: cannot measure the task's prompts (%s)", e)
        return TaskFacts(0, 0, "")
    problems = getattr(task, "problems", None)
    if problems is not None:
        longest = sorted((p.prompt for p in problems), key=len)[-LONGEST_PROMPTS:]
        tokens = max(len(encode(p)) for p in longest)
        source = f"tokenized: the {len(longest)} longest of {len(problems)} prompts"
    else:
        sample = task.sample(random.Random(0), LONGEST_PROMPTS)
        tokens = int(max(len(encode(p.prompt)) for p in sample) * SAMPLED_MARGIN)
        source = f"the longest of {LONGEST_PROMPTS} sampled, +{SAMPLED_MARGIN - 1:.0%}"
    return TaskFacts(tokens, task.max_new_tokens, source)

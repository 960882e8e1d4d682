"""What a learner or actor does with its config on a GPU before it runs: the GPU profile
(``common/config/gpu_profile.py``) applied and logged, TF32 switched on when ``run.tf32``, and
one warning when a GPU node runs the built-in tiny model; on a CPU without fast bf16, the move
of bf16 compute to fp32 (``common/cpu_precision.py``).

:func:`prepare` is called by :func:`common.entrypoint.run_main` for the learner
(``role="learner"``: its device is CUDA when the process sees a GPU) and for each actor
(``role="actor"``: when ``actor.device`` is a CUDA device). Without CUDA it changes nothing and
reads nothing. The profile is computed alike in every process of a run (from the same model,
task and overrides); each process applies and logs the settings of its own sections.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from common import cpu_precision
from common.config import SpecRLConfig
from common.config.gpu_profile import (
    Devices,
    GpuProfile,
    TaskFacts,
    explicit_keys,
    gpu_profile,
    set_keys,
)

log = logging.getLogger(__name__)

Role = Literal["learner", "actor"]
ROLE_SECTIONS: dict[Role, tuple[str, ...]] = {
    "learner": ("learner", "run"),
    "actor": ("actor", "engine", "run"),
}
"""The config sections whose profile settings each process applies and logs."""
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


def prepare(cfg: SpecRLConfig, overrides: Sequence[str], role: Role) -> GpuProfile | None:
    """Apply the GPU profile to ``cfg`` (in place) when this process runs on CUDA with a real
    model, log it, and switch TF32 on when ``run.tf32``; the profile, or None where none
    applies. Raises :class:`~common.config.gpu_profile.UnusualLearningRate` for a learning rate
    far above the model's range."""
    devices = describe_devices(cfg, role)
    cpu_precision.prepare(cfg, overrides, role, devices.cuda)
    profile = None
    if devices.cuda and not cfg.model.path:
        if role == "learner":
            log.warning("%s", tiny_model_warning(cfg, devices))
    elif devices.cuda and cfg.run.gpu_profile:
        profile = profile_for(cfg, overrides, devices, Path(cfg.model.path))
        if profile is not None:
            apply(cfg, profile, role)
    if cfg.run.tf32:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return profile


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


def profile_for(
    cfg: SpecRLConfig, overrides: Sequence[str], devices: Devices, model_dir: Path
) -> GpuProfile | None:
    """The profile for the model in ``model_dir``; None (logged) when it has no config.json yet
    (a preset not built) or describes no decoder the profile knows."""
    model_config = read_json(model_dir / "config.json")
    if model_config is None or "hidden_size" not in model_config:
        log.info("GPU profile: no usable config.json in %s; the defaults stay", model_dir)
        return None
    generation_config = read_json(model_dir / "generation_config.json")
    task = task_facts(cfg, model_dir)
    return gpu_profile(
        model_config, generation_config, devices, task, cfg, explicit_keys(overrides, cfg)
    )


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


def apply(cfg: SpecRLConfig, profile: GpuProfile, role: Role) -> None:
    """Set the profile's settings of ``role``'s sections on ``cfg`` and log them (rank 0 only
    under torchrun), with the profile's warnings."""
    sections = ROLE_SECTIONS[role]
    set_keys(cfg, profile.changes(sections))
    if os.environ.get("RANK", "0") == "0":
        log.info("%s", profile.table(sections))
        for warning in profile.warnings_for(sections):
            log.warning("GPU profile: %s", warning)

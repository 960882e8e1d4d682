"""The learner's optimizer: AdamW's parameter groups (the policy's, a draft adapter's, an EAGLE-3
head's) and the policy's learning-rate schedule (warm-up, then constant, linear or cosine)."""

from __future__ import annotations

import math

import torch
from torch import nn

from common.config.actor import SpecConfig
from common.config.learner import LearnerConfig
from learner.policy import unwrap


def draft_params(model: nn.Module) -> list[nn.Parameter]:
    """The draft adapter's parameters (none for a policy without one)."""
    draft = getattr(unwrap(model), "draft", None)
    return list(draft.parameters()) if draft is not None else []


def eagle_params(model: nn.Module) -> list[nn.Parameter]:
    """The EAGLE-3 head's parameters (none for a policy without one)."""
    eagle = getattr(unwrap(model), "eagle", None)
    return list(eagle.parameters()) if eagle is not None else []


def make_optimizer(
    model: nn.Module, cfg: LearnerConfig, spec: SpecConfig | None = None
) -> torch.optim.Optimizer:
    """AdamW over the model's parameters; its state takes their dtype (fp32 master weights and
    moments unless ``learner.precision=bf16``). A draft adapter's parameters form a second
    group (``spec.adapter_lr``, no weight decay), an EAGLE-3 head's the next (``spec.eagle_lr``,
    no weight decay)."""
    spec = spec or SpecConfig()
    drafts = {id(p) for p in draft_params(model) + eagle_params(model)}
    groups: list[dict] = [
        {"params": [p for p in model.parameters() if id(p) not in drafts]},
    ]
    if draft_params(model):
        groups.append({"params": draft_params(model), "lr": spec.adapter_lr, "weight_decay": 0.0})
    if eagle_params(model):
        # The head's update count (its rate's warm-up) and the learner steps whose gradients it
        # holds (``spec.eagle_accumulate``) ride in its group, so a checkpoint keeps them.
        groups.append(
            {
                "params": eagle_params(model),
                "lr": spec.eagle_lr / spec.eagle_lr_warmup_steps,
                "weight_decay": 0.0,
                EAGLE_GROUP: True,
                "eagle_updates": 0,
                "eagle_pending": 0,
            }
        )
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)


EAGLE_GROUP = "eagle_head"
"""The key that marks the EAGLE-3 head's parameter group."""


def eagle_group(optimizer: torch.optim.Optimizer) -> dict | None:
    """The head's parameter group, None without one."""
    return next((g for g in optimizer.param_groups if g.get(EAGLE_GROUP)), None)


def warm_up_lr(
    optimizer: torch.optim.Optimizer, cfg: LearnerConfig, step: int, total_steps: int = 0
) -> None:
    """Before optimizer step ``step`` (0-based, counted over the run, so a resume continues the
    ramp): the policy's learning rate rises linearly to ``learner.lr`` over
    ``learner.lr_warmup_steps`` steps, then follows ``learner.lr_schedule`` over the
    ``total_steps`` of the run (``run.steps``); the draft groups keep theirs. Nothing with
    neither a warm-up nor a decay."""
    if cfg.lr_warmup_steps > 1 and step + 1 < cfg.lr_warmup_steps:
        optimizer.param_groups[0]["lr"] = cfg.lr * (step + 1) / cfg.lr_warmup_steps
    elif cfg.lr_schedule != "constant" and total_steps > 0:
        optimizer.param_groups[0]["lr"] = cfg.lr * lr_decay_factor(cfg, step, total_steps)
    elif cfg.lr_warmup_steps > 1:
        optimizer.param_groups[0]["lr"] = cfg.lr


def lr_decay_factor(cfg: LearnerConfig, step: int, total_steps: int) -> float:
    """The share of ``learner.lr`` at step ``step`` after the warm-up: 1 at the warm-up's last
    step, ``lr_min_ratio`` at the run's last step (``total_steps - 1``), linear or cosine between."""
    start = max(cfg.lr_warmup_steps - 1, 0)
    span = total_steps - 1 - start
    progress = min(max((step - start) / span, 0.0), 1.0) if span > 0 else 1.0
    if cfg.lr_schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif cfg.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 1.0
    return cfg.lr_min_ratio + (1.0 - cfg.lr_min_ratio) * shape

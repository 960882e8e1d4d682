"""A learner checkpoint's round trip on one process, for the tests of what rides along with the
policy (a draft adapter, an EAGLE-3 head): a step, the checkpoint saved and loaded back with its
optimizer, and the next step taken from both."""

from __future__ import annotations

from pathlib import Path

import torch

from common import metric_names as mn
from common.config.actor import SpecConfig
from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.tokenizer import CharTokenizer
from learner.batch import TrainBatch
from learner.checkpoint import TrainerState, load_checkpoint, restore_optimizer, save_checkpoint
from learner.optim import make_optimizer
from learner.step import Trainer


def checkpoint_round_trip(
    tmp_path: Path,
    tokenizer: CharTokenizer,
    model: torch.nn.Module,
    batch: TrainBatch,
    cfg: LearnerConfig,
    spec: SpecConfig,
) -> tuple[Path, torch.optim.Optimizer, torch.nn.Module, torch.optim.Optimizer]:
    """One step of ``model`` with a fresh optimizer, a checkpoint of it under ``tmp_path``, loaded
    back on the CPU with a fresh optimizer restored from it: (the checkpoint, ``model``'s
    optimizer, the loaded model, its restored optimizer)."""
    optimizer = make_optimizer(model, cfg, spec)
    Trainer(model, optimizer, cfg, SamplingConfig(), spec=spec).step(batch)
    path = save_checkpoint(tmp_path, model, tokenizer, optimizer, TrainerState(1, 1, {}))
    loaded, tensors, _, groups = load_checkpoint(path, torch.device("cpu"))
    restored = make_optimizer(loaded, cfg, spec)
    restore_optimizer(loaded, restored, tensors, groups)
    return path, optimizer, loaded, restored


def assert_next_step_matches(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loaded: torch.nn.Module,
    restored: torch.optim.Optimizer,
    batch: TrainBatch,
    cfg: LearnerConfig,
    spec: SpecConfig,
) -> None:
    """The next step from the original and from the resumed state (:func:`checkpoint_round_trip`)
    has the same draft acceptance and leaves the same weights."""
    m1 = Trainer(model, optimizer, cfg, SamplingConfig(), spec=spec).step(batch)
    m2 = Trainer(loaded, restored, cfg, SamplingConfig(), spec=spec).step(batch)
    assert m1[mn.SPEC_DRAFT_ACCEPTANCE] == m2[mn.SPEC_DRAFT_ACCEPTANCE]
    for name, tensor in model.state_dict().items():
        assert torch.allclose(loaded.state_dict()[name], tensor, atol=1e-6), name

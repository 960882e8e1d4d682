"""The learner's start-up fit check on the real start-up path: the entry point refuses a model
that cannot fit before building it, and ``setup`` trains with the settings ``auto`` picked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import metric_names as mn
from common.config import load_config
from common.config.memory_fit import (
    USABLE_FRACTION,
    GiB,
    Profile,
    Shape,
    Workload,
    estimate,
    ladder,
    user_set,
)
from common.model_args import ModelArgs
from learner.batch import collate
from learner.microbatch import plan_microbatches, row_lengths
from learner.wiring import setup, train_on
from ops.launcher import PreflightError, preflight
from testing.groups import make_groups
from testing.own_model import build_model
from testing.shapes import QWEN25_7B

ROOT = Path(__file__).resolve().parents[3]
# Qwen2.5-7B's shape as the built-in model describes it (written as its config.json).
QWEN_7B = ModelArgs(**QWEN25_7B)


def test_learner_entry_point_refuses_before_building_the_model(tmp_path):
    """A 7.6B config with no weights on a 16 GiB device: the learner stops at start with the
    estimate. Any model built first would fail on the missing weights instead."""
    model = tmp_path / "qwen7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN_7B.to_hf_config()))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "learner.main",
            f"model.path={model}",
            f"run.dir={run_dir}",
            "learner.device_memory_gib=16",
            "redis.url=redis://127.0.0.1:1/0",  # never reached
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "specrl-learner: invalid configuration: the learner does not fit in device memory" in (
        proc.stderr
    ), proc.stderr
    assert "16.0 GiB available (learner.device_memory_gib), 14.4 GiB usable" in proc.stderr
    assert "weights 28.4 + gradients 28.4 + AdamW 56.7" in proc.stderr
    assert "load_policy" not in proc.stderr and "safetensors" not in proc.stderr
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]
    assert not (run_dir / "checkpoints").exists()


def test_specrl_runs_preflight_refuses_with_the_same_resolve_step(tmp_path):
    """``specrl run`` resolves each process's config on its own host first (the same function
    the learner calls at start): the 7.6B config on a 16 GiB device stops the run there."""
    model = tmp_path / "qwen7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN_7B.to_hf_config()))
    overrides = [f"model.path={model}", "learner.device_memory_gib=16"]
    with pytest.raises(PreflightError, match=r"learner: the learner does not fit in device memory"):
        preflight(load_config(overrides), overrides)
    fits = [f"model.path={model}", "learner.device_memory_gib=4096"]
    preflight(load_config(fits), fits)


def test_setup_trains_with_the_settings_auto_picked(tmp_path):
    """A tiny Qwen2 model on a device just big enough for the ladder's last rung: setup applies
    all four settings and the step then runs with them."""
    model = build_model(tmp_path / "model")
    shape = Shape.from_hf_config(json.loads((model / "config.json").read_text()))
    base = load_config([f"model.path={model}", f"run.dir={tmp_path / 'run'}"])
    work = Workload.of(base, shape, ranks=1)
    rungs = ladder(shape, work, Profile.of(base.learner), user_set(base.learner))
    frugal = rungs[-1]
    assert frugal == Profile("bf16-mixed", 512, True, 256)
    need = estimate(shape, work, frugal)["total"]
    assert estimate(shape, work, rungs[-2])["total"] > need + 1024
    memory_gib = (need + 64) / USABLE_FRACTION / GiB
    cfg = load_config(
        [
            f"model.path={model}",
            f"run.dir={tmp_path / 'run'}",
            f"learner.device_memory_gib={memory_gib!r}",
        ]
    )
    state = setup(cfg, tmp_path / "run" / "checkpoints", torch.device("cpu"))
    assert Profile.of(cfg.learner) == frugal
    # The built-in model, checkpointing each layer.
    assert state.trainer.model.gradient_checkpointing
    assert next(state.trainer.model.parameters()).dtype == torch.float32  # bf16-mixed: fp32 master
    vocab = state.args.vocab_size
    batch = collate(make_groups(vocab, n=16, g=8), 0, state.tokenizer.pad_id, torch.device("cpu"))
    metrics = train_on(state, batch, cfg)
    lengths = row_lengths(batch)
    expected = len(plan_microbatches(list(range(len(lengths))), lengths, 512))
    assert metrics[mn.LEARNER_MICROBATCHES] == expected > 1
    assert metrics[mn.LEARNER_SKIPPED] == 0

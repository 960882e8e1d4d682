"""What the ``specrl warm-draft`` tests share (early-exit adapter and EAGLE-3 head alike): the
tiny model they warm up, a quick run's options, and the check that the warm-up wrote its draft
beside model tensors it left alone."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from common.model import Transformer, load_pretrained

TINY = ["model.init_steps=40"]
"""A tiny model of the default task, trained briefly so that its distributions are peaked."""

FAST = ["--prompts", "24", "--samples-per-prompt", "2", "--epochs", "4"]
"""``specrl warm-draft`` options for a quick run on :data:`TINY`."""


def digest(path: Path) -> str:
    """The SHA-256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_draft_saved_beside_untouched_model(
    loaded: Transformer, policy: Transformer, part: str, before_dir: Path
) -> None:
    """``loaded``'s draft ``part`` (``"draft"``: the adapter, ``"eagle"``: the EAGLE-3 head) is the
    trained ``policy``'s to the bit, and every other tensor is the model in ``before_dir``'s."""
    saved = getattr(loaded, part).state_dict()
    trained = getattr(policy, part).state_dict()
    assert saved.keys() == trained.keys()
    for key, value in trained.items():
        torch.testing.assert_close(saved[key], value, rtol=0, atol=0)
    before = load_pretrained(before_dir).state_dict()
    for key, value in loaded.state_dict().items():
        if not key.startswith(f"{part}."):
            torch.testing.assert_close(value, before[key], rtol=0, atol=0)

"""The KL reference (``learner.kl_coef > 0``) is the model the run started from, after a resume
too: read again from its directory (a checkpoint's policy has moved on), and refused when that
directory no longer holds the checkpoint's parameters."""

from __future__ import annotations

import pytest
import torch

from common.config import load_config
from common.model import save_pretrained
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.batch import collate
from learner.checkpoint import TrainerState, save_checkpoint
from learner.wiring import gather_checkpoint, setup, train_on
from testing.groups import make_groups
from testing.models import random_model
from testing.shapes import shape

TOKENIZER = CharTokenizer(BUILTIN_ALPHABET)
CPU = torch.device("cpu")
SHAPE = shape(TOKENIZER.vocab_size, 64, 128, 2, 4, 2, tie_word_embeddings=True)


def test_a_resumed_run_keeps_the_starting_model_as_its_reference(tmp_path):
    model_dir = tmp_path / "model"
    save_pretrained(random_model(seed=0, **SHAPE).train(), model_dir)
    TOKENIZER.save(model_dir)
    cfg = load_config(
        [f"model.path={model_dir}", f"run.dir={tmp_path / 'run'}", "learner.kl_coef=0.5"]
    )
    root = tmp_path / "run" / "checkpoints"
    state = setup(cfg, root, CPU)
    start = {n: p.detach().clone() for n, p in state.trainer.ref_model.named_parameters()}
    batch = collate(make_groups(TOKENIZER.vocab_size), 0, TOKENIZER.pad_id, CPU)
    figures = train_on(state, batch, cfg)
    assert figures["learner/kl"] == 0.0  # the first step: the policy is still the reference
    full = gather_checkpoint(state, None)
    save_checkpoint(root, full, TOKENIZER, None, TrainerState(1, 1))

    resumed = setup(cfg, root, CPU)
    assert resumed.step == 1
    policy = dict(resumed.trainer.model.named_parameters())
    ref = dict(resumed.trainer.ref_model.named_parameters())
    assert all(torch.equal(ref[n], start[n]) for n in start)
    assert any(not torch.equal(ref[n], policy[n]) for n in start)  # the policy moved; not it
    assert train_on(resumed, batch, cfg)["learner/kl"] > 0

    # The directory replaced by another model since: refused, with the reason.
    other = shape(TOKENIZER.vocab_size, 32, 64, 2, 4, 2, tie_word_embeddings=True)
    save_pretrained(random_model(seed=1, **other), model_dir)
    with pytest.raises(ValueError, match="the model the run started from"):
        setup(cfg, root, CPU)

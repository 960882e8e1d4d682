"""Which checkpoint format a learner writes (``learner.checkpoint_format``), its validation, and
the save path's crash hygiene; the 2-rank save/resume is tests/integration/test_sharded_checkpoint.py."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from common.config.learner import LearnerConfig
from common.eagle import EAGLE_FILE, attach_eagle
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.checkpoint import (
    TrainerState,
    latest_checkpoint,
    list_checkpoints,
    load_sharded_model,
    save_checkpoint,
    temp_checkpoint,
)
from learner.checkpoint_sharded import export_checkpoint, is_sharded, main, use_sharded
from learner.optim import make_optimizer
from testing.models import random_model

RANKS = SimpleNamespace(is_main=True, world=2)


@pytest.mark.parametrize(
    ("fmt", "kl", "dist", "sharded"),
    [
        ("auto", 0.0, RANKS, True),
        ("auto", 0.1, RANKS, True),  # the KL reference is the starting model, not the checkpoint
        ("auto", 0.0, None, False),  # one process keeps the full format
        ("sharded", 0.0, None, False),
        ("sharded", 0.0, RANKS, True),
        ("full", 0.0, RANKS, False),
    ],
)
def test_the_format_follows_the_setting_and_the_ranks(fmt, kl, dist, sharded):
    cfg = LearnerConfig(checkpoint_format=fmt, kl_coef=kl)
    assert use_sharded(cfg, dist) is sharded


def test_the_setting_is_validated():
    with pytest.raises(ValueError, match="checkpoint_format must be one of"):
        LearnerConfig(checkpoint_format="dcp")
    assert LearnerConfig(checkpoint_format="sharded", kl_coef=0.1).kl_coef == 0.1


def test_one_process_writes_the_full_format_and_export_refuses_it(tmp_path):
    model = random_model(vocab_size=CharTokenizer(BUILTIN_ALPHABET).vocab_size)
    optimizer = make_optimizer(model, LearnerConfig())
    path = save_checkpoint(
        tmp_path, model, CharTokenizer(BUILTIN_ALPHABET), optimizer, TrainerState(3, 3)
    )
    assert not is_sharded(path) and (path / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="not a sharded checkpoint"):
        export_checkpoint(path, tmp_path / "out")
    with pytest.raises(SystemExit):  # the command says so, with a usage error
        main([str(path), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_save_that_died_leaves_a_dot_directory_the_next_save_removes(tmp_path):
    final, tmp = temp_checkpoint(tmp_path, 1)
    (tmp / "half_written.safetensors").write_bytes(b"x")
    old = tmp_path / ".step_00000001.old"  # the only copy mid-swap: never removed
    old.mkdir()
    assert latest_checkpoint(tmp_path) is None and list_checkpoints(tmp_path) == []
    assert (tmp.stat().st_mode & 0o777) == 0o700
    _, again = temp_checkpoint(tmp_path, 2)
    assert not tmp.exists() and again.is_dir() and old.is_dir()
    assert final.name == "step_00000001"


def test_the_rank_reader_finds_an_eagle_head_in_its_own_file(tmp_path):
    """A full checkpoint keeps the head's tensors in ``eagle/model.safetensors``; the reader a
    multi-rank resume uses finds them there (read here by one process, into plain tensors)."""
    vocab = CharTokenizer(BUILTIN_ALPHABET).vocab_size
    model = random_model(vocab_size=vocab, seed=0)
    attach_eagle(model)
    optimizer = make_optimizer(model, LearnerConfig())
    path = save_checkpoint(
        tmp_path, model, CharTokenizer(BUILTIN_ALPHABET), optimizer, TrainerState(1, 1)
    )
    assert (path / EAGLE_FILE).is_file()
    fresh = random_model(vocab_size=vocab, seed=1)
    attach_eagle(fresh)
    with warnings.catch_warnings():  # DCP's "assuming ... a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load_sharded_model(fresh, path)
    expected = model.state_dict()
    heads = [n for n in expected if n.startswith("eagle.")]
    assert heads
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, expected[name]), name

"""The sharded resume's reads (2 gloo ranks, CPU) give exactly the state one process loads from
the same checkpoint: weights (a tied LM head, a draft adapter's tensors in their own file) and
AdamW moments, step and hyper-parameters, from checkpoints of both layouts (training state in
``training_state/``, or beside the model as older checkpoints have it). A checkpoint that lacks
one of the model's tensors is refused with its name."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.model import WEIGHTS_FILE, attach_draft
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.batch import collate
from learner.checkpoint import (
    TRAINING_DIR,
    TrainerState,
    load_checkpoint,
    load_sharded_model,
    load_sharded_optimizer,
    read_trainer_state,
    restore_optimizer,
    save_checkpoint,
)
from learner.distributed import (
    empty_policy,
    full_model_state,
    full_optimizer_state,
    materialize,
    shard,
)
from learner.optim import make_optimizer
from learner.step import Trainer
from testing.fsdp import group_rank, spawn_ranks
from testing.groups import make_groups
from testing.models import random_model

TOKENIZER = CharTokenizer(BUILTIN_ALPHABET)
VOCAB = TOKENIZER.vocab_size
CPU = torch.device("cpu")
CFG = LearnerConfig(lr=1e-2, weight_decay=0.05, max_tokens_per_microbatch=24)
CASES = ("tied", "draft_older_layout", "missing_tensor")


def _checkpoint(root: Path, case: str) -> Path:
    """A checkpoint written by one process after one AdamW step (lr changed, to see it come back)."""
    model = random_model(VOCAB, tie_word_embeddings=case == "tied").train()
    if case != "tied":
        attach_draft(model, 1)  # rides along untrained: weights, no AdamW state
    optimizer = make_optimizer(model, CFG)
    Trainer(model, optimizer, CFG, SamplingConfig()).step(collate(make_groups(VOCAB), 0, 0, CPU))
    optimizer.param_groups[0]["lr"] = 3e-3
    path = save_checkpoint(root / case, model, TOKENIZER, optimizer, TrainerState(1, 1))
    if case == "draft_older_layout":
        for file in (path / TRAINING_DIR).iterdir():
            file.rename(path / file.name)
        (path / TRAINING_DIR).rmdir()
    if case == "missing_tensor":
        tensors = load_file(str(path / WEIGHTS_FILE))
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    return path


def _worker(rank: int, world: int, port: int, root: str) -> None:
    with group_rank(rank, world, port) as ctx:
        for case in CASES:
            path = next((Path(root) / case).glob("step_*"))
            module = shard(empty_policy(path, "auto", torch.float32))
            materialize(module, CPU)
            try:
                load_sharded_model(module, path)
            except ValueError as e:
                Path(root, f"{case}_{rank}.error").write_text(str(e))
                continue
            optimizer = make_optimizer(module, CFG)
            load_sharded_optimizer(module, optimizer, path, read_trainer_state(path)[1])
            weights = full_model_state(module)
            moments, groups = full_optimizer_state(module, optimizer)
            if rank == 0:
                save_file(weights, os.path.join(root, f"{case}.model.safetensors"))
                save_file(moments, os.path.join(root, f"{case}.optimizer.safetensors"))
                Path(root, f"{case}.groups.json").write_text(json.dumps(groups))
        ctx.barrier()


def test_sharded_reads_equal_the_single_process_load(tmp_path):
    paths = {case: _checkpoint(tmp_path, case) for case in CASES}
    spawn_ranks(_worker, str(tmp_path))

    for case in ("tied", "draft_older_layout"):
        model, tensors, _, groups = load_checkpoint(paths[case], CPU)
        optimizer = make_optimizer(model, CFG)
        restore_optimizer(model, optimizer, tensors, groups)
        weights = load_file(str(tmp_path / f"{case}.model.safetensors"))
        expected = model.state_dict()
        assert set(weights) == set(expected), case
        for name, tensor in expected.items():
            assert torch.equal(weights[name], tensor), (case, name)
        moments = load_file(str(tmp_path / f"{case}.optimizer.safetensors"))
        assert set(moments) == set(tensors), case
        for name, tensor in tensors.items():
            assert torch.equal(moments[name], tensor), (case, name)
        assert not any(k.startswith("draft.") for k in moments)
        saved = json.loads((tmp_path / f"{case}.groups.json").read_text())
        assert saved[0]["lr"] == pytest.approx(3e-3) and saved[0]["weight_decay"] == 0.05
    assert any(k.startswith("draft.") for k in weights)

    for rank in range(2):
        error = (tmp_path / f"missing_tensor_{rank}.error").read_text()
        assert "model.layers.1.mlp.up_proj.weight" in error, error


def test_a_checkpoint_without_optimizer_state_is_refused_by_name(tmp_path):
    path = _checkpoint(tmp_path, "tied")
    shutil.rmtree(path / TRAINING_DIR)
    with pytest.raises(FileNotFoundError, match="optimizer.safetensors"):
        load_sharded_optimizer(torch.nn.Linear(1, 1), None, path, [])

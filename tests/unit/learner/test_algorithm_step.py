"""The algorithm options through the training step: micro-batches and the flattened token
layout of ``learner/step.py`` give the update of the one-batch loss on padded rows."""

from __future__ import annotations

import copy

import pytest
import torch

from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.batch import collate
from learner.loss import ppo_clip_loss
from learner.step import Trainer, loss_options
from testing.groups import make_groups
from testing.models import tiny_model, token_logprobs

VOCAB = CharTokenizer(BUILTIN_ALPHABET).vocab_size
CPU = torch.device("cpu")


def sgd_delta(model, batch, cfg, **kw):
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    Trainer(model, optimizer, cfg, SamplingConfig(), **kw).step(batch)
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def rows_delta(model, batch, cfg, agg_tokens=0):
    """One forward over the padded rows, the loss with each row one sequence."""
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = model.model.embed_tokens(batch.input_ids)
    logits = model.head(model.run_layers(x, None, None, 0, model.args.num_hidden_layers))
    lp = token_logprobs(logits[:, :-1], batch.targets, 1.0, 1.0) * batch.mask
    out = ppo_clip_loss(
        lp,
        batch.behaviour_logprobs,
        batch.advantages,
        batch.mask,
        cfg.clip_eps,
        cfg.dual_clip,
        options=loss_options(cfg, agg_tokens),
    )
    out.loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def max_diff(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize(
    "options",
    [
        {"ratio_level": "sequence", "loss_agg": "seq_mean", "clip_eps": 0.05},
        {"loss_agg": "seq_sum", "loss_agg_tokens": 7, "clip_eps_high": 0.28},
        {"loss_agg": "seq_mean", "tis_cap": 1.05},
    ],
)
def test_options_give_the_one_batch_update_in_microbatches(options):
    model = tiny_model(VOCAB)
    batch = collate(make_groups(VOCAB, n=4, g=4), 0, 0, CPU)
    batch.behaviour_logprobs = batch.behaviour_logprobs - 0.1 * batch.mask  # ratios above 1
    cfg = LearnerConfig(grad_clip=0.0, **options)
    whole = sgd_delta(model, batch, cfg)
    micro = sgd_delta(
        model, batch, LearnerConfig(grad_clip=0.0, max_tokens_per_microbatch=24, **options)
    )
    assert max_diff(whole, micro) < 1e-5
    assert max_diff(whole, rows_delta(model, batch, cfg)) < 1e-5
    # And the options change the update (not the default's).
    assert max_diff(whole, sgd_delta(model, batch, LearnerConfig(grad_clip=0.0))) > 1e-4

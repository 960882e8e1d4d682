"""Memory-bounded training step: micro-batches with exact gradient accumulation, chunked
log-probs at completion positions only, activation checkpointing, bf16 autocast."""

import copy

import pytest
import torch

from common.config.actor import SpecConfig
from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.batch import collate
from learner.loss import early_exit_kl, ppo_clip_loss
from learner.microbatch import plan_microbatches, row_lengths, shard_rows
from learner.step import Trainer
from testing.groups import make_groups
from testing.models import tiny_model, token_logprobs

VOCAB = CharTokenizer(BUILTIN_ALPHABET).vocab_size
CPU = torch.device("cpu")


def sgd_delta(model, batch, cfg, sampling=None, **kw):
    """Parameter change of one plain-SGD step (lr 1, no clipping): minus the gradient, so the
    comparison sees the gradient itself (AdamW's first step would hide a scale error)."""
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = Trainer(model, optimizer, cfg, sampling or SamplingConfig(), **kw).step(batch)
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}, metrics


def max_diff(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def legacy_delta(model, batch, cfg, sampling, spec=None):
    """The step as it was before micro-batching: fp32 logits [B, S, V] at every position, one
    forward, one backward (reference for the new path)."""
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    L = model.args.num_hidden_layers
    x = model.model.embed_tokens(batch.input_ids)
    if spec is not None:
        h_exit = model.run_layers(x, None, None, 0, spec.exit_layer)
        logits = model.head(model.run_layers(h_exit, None, None, spec.exit_layer, L))[:, :-1]
        exit_logits = model.head(h_exit)[:, :-1]
    else:
        logits = model.head(model.run_layers(x, None, None, 0, L))[:, :-1]
    lp = token_logprobs(logits, batch.targets, sampling.temperature, sampling.top_p)
    out = ppo_clip_loss(lp, batch.behaviour_logprobs, batch.advantages, batch.mask, 0.2, 3.0)
    loss = out.loss
    if spec is not None:
        from common.sampling import processed_logprobs

        kl = early_exit_kl(
            processed_logprobs(logits, sampling.temperature),
            processed_logprobs(exit_logits, sampling.temperature),
            batch.mask,
        )
        loss = loss + spec.aux_coef * kl
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def setting():
    model = tiny_model(VOCAB)
    groups = make_groups(VOCAB, n=4, g=4)
    batch = collate(groups, 0, 0, CPU)
    return model, groups, batch


def test_new_path_equals_the_full_logits_step(setting):
    model, _, batch = setting
    spec = SpecConfig(method="early_exit", exit_layer=1, aux_coef=0.5)
    sampling = SamplingConfig(temperature=0.8)
    cfg = LearnerConfig(grad_clip=0.0, logprob_chunk_tokens=5, max_tokens_per_microbatch=30)
    new, metrics = sgd_delta(model, batch, cfg, sampling, spec=spec)
    assert metrics["learner/microbatches"] >= 3
    assert max_diff(new, legacy_delta(model, batch, cfg, sampling, spec)) < 1e-5


def test_microbatches_give_the_one_batch_update_and_per_microbatch_means_do_not(setting):
    model, groups, batch = setting
    whole, m1 = sgd_delta(model, batch, LearnerConfig(grad_clip=0.0))
    cfg = LearnerConfig(grad_clip=0.0, max_tokens_per_microbatch=24, logprob_chunk_tokens=3)
    micro, m2 = sgd_delta(model, batch, cfg)
    assert m1["learner/microbatches"] == 1 and m2["learner/microbatches"] >= 4
    assert max_diff(whole, micro) < 1e-5
    assert abs(m1["learner/loss"] - m2["learner/loss"]) < 1e-6
    assert abs(m1["learner/clip_frac"] - m2["learner/clip_frac"]) < 1e-6
    # Negative control: accumulating per-micro-batch token means (each group alone, averaged)
    # is a different update, far outside the tolerance above.
    naive = None
    for group in groups:
        part, _ = sgd_delta(model, collate([group], 0, 0, CPU), LearnerConfig(grad_clip=0.0))
        naive = part if naive is None else {n: naive[n] + part[n] for n in part}
    naive = {n: v / len(groups) for n, v in naive.items()}
    assert max_diff(whole, naive) > 1e-3


def test_activation_checkpointing_gives_the_same_update(setting):
    model, _, batch = setting
    plain, _ = sgd_delta(model, batch, LearnerConfig(grad_clip=0.0))
    ckpt, _ = sgd_delta(model, batch, LearnerConfig(grad_clip=0.0, activation_checkpointing=True))
    assert max_diff(plain, ckpt) < 1e-6


def test_bf16_autocast_keeps_fp32_master_weights_and_is_close(setting):
    model, _, batch = setting
    fp32, m32 = sgd_delta(model, batch, LearnerConfig(grad_clip=0.0))
    bf16, m16 = sgd_delta(model, batch, LearnerConfig(grad_clip=0.0, precision="bf16-mixed"))
    assert all(v.dtype == torch.float32 for v in bf16.values())
    assert abs(m32["learner/loss"] - m16["learner/loss"]) < 0.05
    cos = torch.nn.functional.cosine_similarity(
        torch.cat([v.flatten() for v in fp32.values()]),
        torch.cat([v.flatten() for v in bf16.values()]),
        dim=0,
    )
    assert cos > 0.95


def test_a_non_finite_microbatch_skips_the_whole_step():
    model = tiny_model(VOCAB)
    groups = make_groups(VOCAB, n=4, g=4)
    groups[3].completions[0].reward = 1e300  # inf in float32: NaN advantages in one group only
    batch = collate(groups, 0, 0, CPU)
    cfg = LearnerConfig(max_tokens_per_microbatch=24)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = Trainer(model, optimizer, cfg, SamplingConfig()).step(batch)
    assert metrics["learner/skipped"] == 1.0 and metrics["learner/microbatches"] > 1
    assert all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    assert not optimizer.state


def test_plans_respect_the_budget_and_shards_partition_the_rows(setting):
    _, _, batch = setting
    lengths = row_lengths(batch)
    assert lengths == [int(r.nonzero().max()) + 2 for r in batch.mask]
    rows = list(range(len(lengths)))
    for budget in (1, 20, 40, 10_000):
        plan = plan_microbatches(rows, lengths, budget)
        assert sorted(i for mb in plan for i in mb) == rows
        for mb in plan:
            assert len(mb) == 1 or len(mb) * max(lengths[i] for i in mb) <= budget
    shards = [shard_rows(lengths, 3, r) for r in range(3)]
    assert sorted(i for s in shards for i in s) == rows
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(lengths)


def test_pure_bf16_trains_bf16_weights_and_state(setting):
    model, _, batch = setting
    model = copy.deepcopy(model).to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = LearnerConfig(precision="bf16", max_tokens_per_microbatch=24)
    metrics = Trainer(model, optimizer, cfg, SamplingConfig()).step(batch)
    assert metrics["learner/skipped"] == 0.0
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in optimizer.state.values())
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())

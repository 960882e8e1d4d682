"""Every draft step trained (learner/eagle_loss.py ``ttt_states``) and the head's online schedule
(learner/step.py): the K-step unroll is the cached draft chain step by step, at one pass of the
head's layer per step; the learner reports each step's acceptance before its update, weights
later steps down, warms the head's rate up and accumulates its gradient over learner steps."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from common import metric_names as mn
from common.config.actor import SpecConfig
from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.eagle import EAGLE_PREFIX, attach_eagle
from common.layers import KVCache
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.batch import collate
from learner.eagle_loss import eagle_states, eagle_terms, ttt_states
from learner.optim import eagle_group, make_optimizer
from learner.policy import backbone
from learner.step import Trainer, draft_acceptance_key
from testing.groups import make_groups
from testing.models import random_model, tiny_model

ONE = SpecConfig(
    method="eagle3", eagle_lr=1e-2, eagle_steps=1, eagle_accumulate=1, eagle_lr_warmup_steps=1
)


def _policy(seed: int = 3) -> torch.nn.Module:
    model = random_model(97, num_hidden_layers=3).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    # A random head: the chain's later steps differ from step 1 in every entry.
    attach_eagle(model, vocab_ids=torch.arange(3, 97, 2), seed=seed, init="random")
    with torch.no_grad():
        for p in model.eagle.parameters():
            p.mul_(5.0)  # N(0, 0.1): steps far from each other
    return model


@torch.no_grad()
def _chain(model, ids: torch.Tensor, g: torch.Tensor, t: int, steps: int) -> list[torch.Tensor]:
    """The draft chain of entry t, step by step over a fresh KV cache: step 1 over positions
    0 .. t (the head's cache filled), then each step one token at t + j - 1 reading the last
    step's output and token t + j, as ``EagleDrafter.draft`` runs it."""
    B = ids.shape[0]
    cache = KVCache(model.args, B, ids.shape[1] + steps)
    pos = torch.arange(t + 1).expand(B, -1)
    out = model.run_eagle(ids[:, 1 : t + 2], g[:, : t + 1], pos, cache)[:, t : t + 1]
    outs = [out[:, 0]]
    for j in range(2, steps + 1):
        if t + j >= ids.shape[1]:
            break
        position = torch.full((B, 1), t + j - 1)
        out = model.run_eagle(ids[:, t + j : t + j + 1], out, position, cache)
        outs.append(out[:, 0])
    return outs


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
@torch.no_grad()
def test_the_k_step_unroll_is_the_cached_draft_chain_step_by_step(steps):
    model = _policy()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(steps))
    aux: list[torch.Tensor] = []
    backbone(model, ids, aux=aux)
    outs = ttt_states(model, ids, aux, steps)
    assert [o.shape[1] for o in outs] == [9 - j for j in range(1, steps + 1)]
    torch.testing.assert_close(outs[0], eagle_states(model, ids, aux))
    g = model.eagle.combine(aux)
    for t in range(8):
        for j, expected in enumerate(_chain(model, ids, g, t, steps), start=1):
            torch.testing.assert_close(outs[j - 1][:, t], expected, rtol=1e-4, atol=1e-4)
    if steps > 1:  # the later steps are not step 1 again: the check can tell them apart
        assert (outs[1][:, 1:] - outs[0][:, 2:]).abs().max() > 1e-2


def test_the_unroll_costs_one_pass_of_the_layer_per_step():
    model = _policy()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    aux: list[torch.Tensor] = []
    backbone(model, ids, aux=aux)
    rows: list[int] = []
    hook = model.eagle.midlayer.self_attn.q_proj.register_forward_hook(
        lambda module, args, out: rows.append(args[0].shape[1])
    )
    try:
        for steps in (1, 2, 3, 4):
            rows.clear()
            ttt_states(model, ids, aux, steps)
            # One projection per step over that step's entries: the parameters are read K times
            # and the rows projected sum to at most K times the sequence (linear in K).
            assert rows == [12 - j for j in range(1, steps + 1)]
    finally:
        hook.remove()


def test_only_the_head_gets_a_gradient_through_every_step():
    model = _policy()
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(1))
    sel = torch.ones(2, 7, dtype=torch.bool)
    aux: list[torch.Tensor] = []
    h, _ = backbone(model, ids, aux=aux)
    kl, accepts, counts = eagle_terms(model, ids, aux, h, sel, 1.0, 3, steps=4, decay=0.8)
    assert counts.tolist() == [12.0, 10.0, 8.0, 6.0]  # entries t with t + j <= 6, two rows
    assert accepts.shape == (4,) and bool((accepts > 0).all())
    kl.backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == name.startswith(EAGLE_PREFIX), name


def test_later_steps_are_weighted_by_the_decay():
    model = _policy()
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(2))
    sel = torch.ones(2, 7, dtype=torch.bool)
    aux: list[torch.Tensor] = []
    with torch.no_grad():
        h, _ = backbone(model, ids, aux=aux)
        parts = [eagle_terms(model, ids, aux, h, sel, 1.0, 0, steps=j)[0] for j in (1, 2, 3)]
        decayed = eagle_terms(model, ids, aux, h, sel, 1.0, 0, steps=3, decay=0.5)[0]
    step = [float(parts[0]), float(parts[1] - parts[0]), float(parts[2] - parts[1])]
    assert all(s > 0 for s in step)
    assert float(decayed) == pytest.approx(step[0] + 0.5 * step[1] + 0.25 * step[2], rel=1e-5)


def _setup():
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    model = tiny_model(tokenizer.vocab_size)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    attach_eagle(model, vocab_ids=torch.arange(0, tokenizer.vocab_size, 2), seed=1)
    batch = collate(make_groups(tokenizer.vocab_size), 0, tokenizer.pad_id, torch.device("cpu"))
    return model, batch


def test_each_steps_acceptance_is_measured_on_the_batch_before_the_update():
    model, batch = _setup()
    spec = replace(ONE, eagle_steps=3)
    cfg = LearnerConfig(lr=1e-3)
    before = copy.deepcopy(model)
    metrics = Trainer(
        model, make_optimizer(model, cfg, spec), cfg, SamplingConfig(), spec=spec
    ).step(batch)
    sel = batch.mask > 0
    aux: list[torch.Tensor] = []
    with torch.no_grad():
        h, _ = backbone(before, batch.input_ids, aux=aux)
        _, accepts, counts = eagle_terms(before, batch.input_ids, aux, h, sel, 1.0, 0, steps=3)
    rates = (accepts / counts).tolist()
    for j, rate in enumerate(rates, start=1):
        assert metrics[draft_acceptance_key(j)] == pytest.approx(rate, rel=1e-4)
    assert metrics[mn.SPEC_DRAFT_ACCEPTANCE] == metrics[draft_acceptance_key(1)]
    chain = 1 + rates[0] + rates[0] * rates[1] + rates[0] * rates[1] * rates[2]
    assert metrics[mn.SPEC_DRAFT_CHAIN_ESTIMATE] == pytest.approx(chain, rel=1e-4)
    assert draft_acceptance_key(4) not in metrics


def _head(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.eagle.state_dict().items()}


def _changed(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_the_head_accumulates_over_learner_steps_and_warms_its_rate_up():
    model, batch = _setup()
    spec = replace(ONE, eagle_accumulate=2, eagle_lr_warmup_steps=4)
    cfg = LearnerConfig(lr=1e-12)  # the policy holds still: both steps see the same states
    single = copy.deepcopy(model)
    opt = make_optimizer(model, cfg, spec)
    start = _head(model)
    first = Trainer(model, opt, cfg, SamplingConfig(), spec=spec).step(batch)
    assert not _changed(start, _head(model))  # held: half its gradients are in
    assert all(p.grad is not None for p in model.eagle.parameters())
    assert eagle_group(opt)["eagle_pending"] == 1
    second = Trainer(model, opt, cfg, SamplingConfig(), spec=spec).step(batch)
    assert _changed(start, _head(model)) and eagle_group(opt)["eagle_updates"] == 1
    assert second[mn.SPEC_EAGLE_LR] == pytest.approx(spec.eagle_lr / 4)
    assert first[mn.SPEC_DRAFT_ACCEPTANCE] == pytest.approx(second[mn.SPEC_DRAFT_ACCEPTANCE])
    # Two equal steps' mean is one step's gradient: the same update as without accumulating.
    one = replace(spec, eagle_accumulate=1)
    Trainer(single, make_optimizer(single, cfg, one), cfg, SamplingConfig(), spec=one).step(batch)
    for key, value in _head(single).items():
        torch.testing.assert_close(_head(model)[key], value, rtol=1e-5, atol=1e-7)
    rates = []
    for _ in range(8):
        Trainer(model, opt, cfg, SamplingConfig(), spec=spec).step(batch)
        rates.append(eagle_group(opt)["lr"])
    # Set at each update (every second step): 2/4, 3/4, then the full rate from the 4th on.
    quarter = spec.eagle_lr / 4
    assert rates == pytest.approx(
        [quarter, 2 * quarter, 2 * quarter, 3 * quarter, 3 * quarter] + [4 * quarter] * 3
    )


def test_a_skipped_step_drops_the_heads_accumulated_gradients():
    model, batch = _setup()
    spec = replace(ONE, eagle_accumulate=3)
    cfg = LearnerConfig(lr=1e-3)
    opt = make_optimizer(model, cfg, spec)
    Trainer(model, opt, cfg, SamplingConfig(), spec=spec).step(batch)
    assert eagle_group(opt)["eagle_pending"] == 1
    bad = copy.deepcopy(batch)
    bad.advantages[0] = float("nan")
    metrics = Trainer(model, opt, cfg, SamplingConfig(), spec=spec).step(bad)
    assert metrics[mn.LEARNER_SKIPPED] == 1.0
    assert eagle_group(opt)["eagle_pending"] == 0
    assert all(p.grad is None for p in model.eagle.parameters())


def test_the_head_starts_at_the_configured_rate_over_its_warm_up():
    model, _ = _setup()
    spec = SpecConfig(method="eagle3")
    assert (spec.eagle_lr, spec.eagle_lr_warmup_steps, spec.eagle_accumulate) == (1e-4, 10, 4)
    opt = make_optimizer(model, LearnerConfig(), spec)
    assert eagle_group(opt)["lr"] == pytest.approx(1e-5)
    for bad in ({"eagle_accumulate": 0}, {"eagle_lr_warmup_steps": 0}, {"eagle_step_decay": 0.0}):
        with pytest.raises(ValueError, match="spec.eagle_"):
            SpecConfig(method="eagle3", **bad)

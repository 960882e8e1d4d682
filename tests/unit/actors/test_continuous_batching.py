"""Continuous batching and the block-pool KV cache of the torch engine: completions refill the
batch as rows finish, and everything stays exact on those paths (refill in the middle of other
rows' rollouts, prompt KV copied from siblings, rollback of the cache tail, in-flight swaps, bf16).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from actors.decoding.ngram import NgramDrafter
from actors.engines.torch.engine import TorchEngine
from common.config.actor import SpecConfig
from testing.lossless_check import (
    assert_recorded_logprobs_exact,
    exact_sequence_logprobs,
    peaky_model,
    rollouts_pvalue,
)
from testing.models import token_logprobs
from tests.unit.actors.engine_helpers import swap_after

EOS = 2
NO_EOS = 99
PROMPTS = [[1, 4, 5, 4], [1, 3]]
SPECS = [
    SpecConfig(method="none"),
    SpecConfig(method="ngram", k=3, ngram_max_n=2, ngram_min_n=1, adaptive=False),
    SpecConfig(method="early_exit", k=2, exit_layer=1, adaptive=False),
    SpecConfig(
        method="hybrid", k=2, exit_layer=1, ngram_max_n=2, ngram_sources="group", adaptive=False
    ),
]


def _id(spec: SpecConfig) -> str:
    return f"{spec.method}-k{spec.k}"


def pvalue(model, prompt, rollouts, max_new, eos, temperature=1.0, top_p=1.0) -> float:
    exact = exact_sequence_logprobs(model, prompt, max_new, temperature, top_p, eos)
    return rollouts_pvalue(exact, rollouts)


# ---------------------------------------------------------------- refill: exactness


@pytest.mark.parametrize("spec", SPECS[:2], ids=_id)
def test_refilled_rows_follow_the_plain_distribution(spec):
    # 2 prompts x 3000 completions through 40 rows: almost every completion joins the batch in
    # the middle of other rows' rollouts, with its prompt KV copied from a sibling.
    model = peaky_model(vocab=6, seed=1, scale=8.0)
    engine = TorchEngine(model, EOS, 0, 1.0, seed=5, spec=spec, max_rows=40)
    out = engine.generate(PROMPTS, 3000, 3)
    for prompt, group in zip(PROMPTS, out, strict=True):
        assert len(group) == 3000
        p = pvalue(model, prompt, group, 3, EOS)
        assert p > 1e-3, f"{spec.method}: p = {p:.2e}"
    assert engine.cache.used_blocks() == 0  # every row gave its blocks back


def test_the_refill_check_detects_a_lost_prompt_copy():
    # Negative control: newcomers whose copied prompt KV is lost (zeroed past slot 0) no longer
    # sample the right distribution, and the same check says so.
    model = peaky_model(vocab=6, seed=1, scale=8.0)
    engine = TorchEngine(model, EOS, 0, 1.0, seed=5, max_rows=40)
    cache, copy = engine.cache, engine.cache.copy_prefix
    copied = {"rows": 0}

    def lossy_copy(pairs):
        copy(pairs)
        for _, dst, length in pairs:
            start = cache.tables[dst][0] * cache.block_size
            cache.k[:, start + 1 : start + length] = 0
            cache.v[:, start + 1 : start + length] = 0
            copied["rows"] += 1

    cache.copy_prefix = lossy_copy
    out = engine.generate(PROMPTS, 3000, 3)
    assert copied["rows"] > 2500  # most newcomers copy their prompt from a sibling
    assert pvalue(model, PROMPTS[0], out[0], 3, EOS) < 1e-3


@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_greedy_with_refill_equals_greedy_static(spec):
    model = peaky_model(vocab=16, seed=0, scale=30.0)
    prompts = [[1, 5, 6, 5, 6], [1, 7], [1, 8, 9, 8, 9, 8, 9], [1, 3]]
    static = TorchEngine(model, EOS, 0, temperature=0.0, static_batching=True)
    expected = static.generate(prompts, 3, 12)
    engine = TorchEngine(model, EOS, 0, temperature=0.0, spec=spec, max_rows=2)
    for _ in range(2):  # the second call drafts from history too (n-gram)
        got = engine.generate(prompts, 3, 12)
        assert [[r.token_ids.tolist() for r in g] for g in got] == [
            [r.token_ids.tolist() for r in g] for g in expected
        ]


@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_refill_and_rollback_keep_behaviour_logprobs_exact(spec):
    # Prompt KV copied from siblings, drafts rejected (the tail trimmed), rows refilled: every
    # recorded log-prob still equals a fresh full forward over the final sequence.
    model = peaky_model(vocab=12, seed=3, scale=2.0)
    prompts = [[1, 5, 6, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 3], [1, 7], [1, 8, 9]]
    engine = TorchEngine(model, EOS, 0, 0.8, 0.95, seed=3, spec=spec, max_rows=5, block_size=4)
    out = engine.generate(prompts, 4, 20)
    assert_recorded_logprobs_exact(model, prompts, out, 0.8, 0.95)
    assert engine.cache.used_blocks() == 0


# ---------------------------------------------------------------- refill: in-flight swaps


def staggered(mode: str, old, new):
    """8000 completions of 3 tokens (no EOS), 1500 joining per step, at most 4500 at once; the
    weights change after step 4: 3000 rows are then in flight (1 or 2 old tokens), 3000 are done
    and 2000 have not started."""
    engine = TorchEngine(
        old, NO_EOS, 0, 1.0, seed=0, version=0, inflight=mode, max_rows=4500, max_admit=1500
    )
    out = engine.generate([PROMPTS[0]], 8000, 3, weight_source=swap_after(4, 1, new))[0]
    return engine, out


@pytest.mark.parametrize("mode", ["verify_on_swap", "verify_on_finish"])
def test_refill_with_an_in_flight_swap_is_exact(mode):
    old, new = peaky_model(6, 1, 6.0), peaky_model(6, 2, 6.0)
    engine, out = staggered(mode, old, new)
    before = [r for r in out if set(r.token_versions.tolist()) == {0}]
    after = [r for r in out if set(r.token_versions.tolist()) == {1}]
    assert len(before) == 3000 and len(after) == 5000  # no mixed row: all verified
    assert pvalue(new, PROMPTS[0], after, 3, NO_EOS) > 0.01
    assert pvalue(old, PROMPTS[0], before, 3, NO_EOS) > 0.01
    stats = engine.stats()
    assert stats["verify/swaps"] == 1
    assert stats["verify/inflight_tokens"] == 1500 * 2 + 1500 * 1
    assert 0 < stats["verify/salvaged_frac"] < 1
    assert engine.swapper.kept == {} and engine.cache.used_blocks() == 0


def test_refill_with_keep_is_not_exact():
    # Negative control: the same check rejects keep (the in-flight rows keep stale tokens).
    old, new = peaky_model(6, 1, 6.0), peaky_model(6, 2, 6.0)
    _, out = staggered("keep", old, new)
    mixed = [r for r in out if set(r.token_versions.tolist()) == {0, 1}]
    assert len(mixed) == 3000
    after = [r for r in out if 1 in r.token_versions.tolist()]
    assert pvalue(new, PROMPTS[0], after, 3, NO_EOS) < 0.01


def test_abort_with_refill_restarts_the_rows_in_flight():
    old, new = peaky_model(6, 1, 6.0), peaky_model(6, 2, 6.0)
    engine, out = staggered("abort", old, new)
    after = [r for r in out if set(r.token_versions.tolist()) == {1}]
    assert len(after) == 5000
    assert pvalue(new, PROMPTS[0], after, 3, NO_EOS) > 0.01
    assert engine.stats()["verify/wasted_tokens"] == 4500


# ---------------------------------------------------------------- groups, memory, dtype


def test_groups_are_handed_over_as_soon_as_they_are_done():
    model = peaky_model(vocab=12, seed=0, scale=2.0)
    prompts = [[1, 5], [1, 6], [1, 7], [1, 8]]
    steps = {"n": 0}

    def count():
        steps["n"] += 1

    for batching, expect_early in (("continuous", True), ("static", False)):
        seen = []
        static = batching == "static"
        engine = TorchEngine(model, EOS, 0, seed=1, static_batching=static, max_rows=3)
        out = engine.generate(
            prompts,
            3,
            16,
            weight_source=count,
            on_group=lambda i, group, seen=seen: seen.append((i, steps["n"], group)),
        )
        assert sorted(i for i, _, _ in seen) == [0, 1, 2, 3]
        for i, _, group in seen:
            assert group is out[i]
        early = seen[0][1] < steps["n"]
        assert early == expect_early, batching


def test_dynamic_cache_holds_less_than_the_static_one():
    model = peaky_model(vocab=12, seed=0, scale=2.0)
    prompts = [[1, 5, 6, 7], [1, 6], [1, 7, 8], [1, 8]]
    peaks = {}
    for batching in ("static", "continuous"):
        static = batching == "static"
        engine = TorchEngine(model, EOS, 0, seed=1, static_batching=static, block_size=4)
        engine.generate(prompts, 8, 40)
        peaks[batching] = engine.cache.peak_bytes
        assert engine.cache.used_blocks() == 0
    # Static: 32 rows x (4 + 40 + k + 1) slots up front; dynamic: what the rows held.
    assert peaks["continuous"] < 0.8 * peaks["static"]


def test_bf16_model_runs_with_a_bf16_cache():
    model = peaky_model(vocab=12, seed=0, scale=2.0).to(torch.bfloat16)
    new = peaky_model(vocab=12, seed=1, scale=2.0).to(torch.bfloat16)
    spec = SpecConfig(method="ngram", k=3, ngram_max_n=2, ngram_min_n=1, adaptive=False)
    engine = TorchEngine(model, EOS, 0, 1.0, seed=0, version=0, spec=spec, max_rows=5)
    out = engine.generate(PROMPTS, 4, 10, weight_source=swap_after(3, 1, new))
    assert engine.cache.k.dtype == torch.bfloat16
    assert engine.model.lm_head.weight.dtype == torch.bfloat16  # the swapped-in model too
    for prompt, group in zip(PROMPTS, out, strict=True):
        for r in group:
            assert np.isfinite(r.behaviour_logprobs).all()
            weights = new if r.token_versions.tolist()[-1] == 1 else model
            seq = torch.tensor([prompt + r.token_ids.tolist()])
            with torch.no_grad():
                lp = token_logprobs(weights(seq)[:, :-1], seq[:, 1:], 1.0)[0, len(prompt) - 1 :]
            # bf16 activations: the cached and the fresh forward round differently.
            np.testing.assert_allclose(r.behaviour_logprobs, lp.float().numpy(), atol=0.1)


# ---------------------------------------------------------------- incremental n-gram index


@pytest.mark.parametrize("sources", ["prompt", "group", "history"])
def test_incremental_ngram_index_gives_the_drafts_of_a_fresh_one(sources):
    rng = random.Random(0)
    live = NgramDrafter(max_n=3, min_n=1, sources=sources)
    live.remember("p", [1, 7, 8, 9, 3, 4])
    live.begin()
    keys = ["p", "p", "q", "p"]
    contexts = [[1, 7], [1, 7], [1, 4], [1, 7]]
    for row, (key, context) in enumerate(zip(keys, contexts, strict=True)):
        live.add_row(row, key, context)
    hits = 0
    for step in range(200):
        for row, context in enumerate(contexts):
            if step % 17 == row and len(context) > 4:  # a rollback now and then
                del context[rng.randrange(2, len(context)) :]
                live.truncate(row, len(context))
            added = [rng.choice([3, 4, 5, 7, 8, 9]) for _ in range(rng.randrange(1, 4))]
            context += added
            live.extend(row, added)
        got = live.propose_rows(range(len(contexts)), 3)
        fresh = NgramDrafter(max_n=3, min_n=1, sources=sources)
        fresh.remember("p", [1, 7, 8, 9, 3, 4])
        assert got == fresh.propose(contexts, keys, 3)
        hits += sum(bool(d) for d in got)
    assert hits > 400  # the comparison is about real drafts, not empty ones


def test_incremental_ngram_index_without_rollback_would_differ():
    # Negative control: skipping truncate (stale n-grams of dropped tokens stay) changes drafts.
    live = NgramDrafter(max_n=2, min_n=1, sources="prompt")
    live.begin()
    live.add_row(0, "p", [1, 5, 6, 9, 5])
    context = [1, 5, 6, 5]
    stale = live.propose_rows([0], 2)
    live.truncate(0, 3)
    live.extend(0, [5])
    assert live.propose_rows([0], 2) == NgramDrafter(2, 1, sources="prompt").propose(
        [context], ["p"], 2
    )
    assert stale != live.propose_rows([0], 2)

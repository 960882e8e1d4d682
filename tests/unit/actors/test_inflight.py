"""Delayed verification: rollouts in flight when new weights arrive end as exact samples of the
new policy (both verify modes), while `keep` does not; versions and caches stay consistent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.engines.torch.engine import TorchEngine
from common.config.actor import SpecConfig
from common.model import Transformer
from testing.lossless_check import exact_sequence_logprobs, peaky_model, rollouts_pvalue
from testing.models import token_logprobs
from tests.unit.actors.engine_helpers import swap_after

NO_EOS = 99  # outside the vocabulary: every row runs to the budget, so all are in flight at a swap
PROMPT = [1, 4, 5, 4]


def model(seed: int, vocab: int = 6, scale: float = 6.0) -> Transformer:
    return peaky_model(vocab, seed, scale)


def sample(
    mode: str, old: Transformer, new: Transformer, rows: int, max_new: int, spec=None, seed=0
):
    engine = TorchEngine(
        old, NO_EOS, 0, temperature=1.0, seed=seed, version=0, spec=spec, inflight=mode
    )
    out = engine.generate([PROMPT], rows, max_new, weight_source=swap_after(1, 1, new))[0]
    return engine, out


def pvalue_against(target: Transformer, rollouts, max_new: int) -> float:
    exact = exact_sequence_logprobs(target, PROMPT, max_new, 1.0, 1.0, NO_EOS)
    return rollouts_pvalue(exact, rollouts)


@pytest.mark.parametrize("mode", ["verify_on_swap", "verify_on_finish", "abort"])
def test_sequences_after_a_swap_follow_the_new_policy(mode):
    old, new = model(1), model(2)
    engine, out = sample(mode, old, new, rows=8000, max_new=3)
    p = pvalue_against(new, out, 3)
    assert p > 0.01, f"{mode}: p = {p:.2e}"
    stats = engine.stats()
    assert stats["verify/swaps"] == 1
    if mode != "abort":
        assert 0 < stats["verify/salvaged_frac"] < 1
        assert "verify/acceptance_gap1" in stats


def test_keep_does_not_follow_the_new_policy():
    # Negative control: the same test rejects the PipelineRL-style keep (stale prefix kept).
    old, new = model(1), model(2)
    _, out = sample("keep", old, new, rows=8000, max_new=3)
    assert pvalue_against(new, out, 3) < 0.01


def test_verify_with_speculative_decoding_is_exact_too():
    old, new = model(1), model(2)
    _, out = sample(
        "verify_on_swap",
        old,
        new,
        rows=8000,
        max_new=3,
        spec=SpecConfig(method="ngram", k=1, adaptive=False),
    )
    assert pvalue_against(new, out, 3) > 0.01


@pytest.mark.parametrize("mode", ["verify_on_swap", "verify_on_finish", "abort", "keep"])
def test_per_token_versions(mode):
    old, new = model(1), model(2)
    engine = TorchEngine(old, NO_EOS, 0, seed=0, version=0, inflight=mode)
    out = engine.generate([PROMPT], 64, 4, weight_source=swap_after(2, 1, new))[0]
    for r in out:
        versions = r.token_versions.tolist()
        assert len(versions) == len(r.token_ids) == 4
        if mode == "keep":
            # Two tokens were generated before the swap (prefill + one decoding step).
            assert versions == [0, 0, 1, 1]
        else:
            assert versions == [1, 1, 1, 1]


@pytest.mark.parametrize("mode", ["verify_on_swap", "verify_on_finish"])
def test_cut_and_resume_keeps_the_cache_consistent(mode):
    # After cuts, truncation and resumed decoding, every kept token's behaviour log-prob equals
    # a fresh forward of the new weights over the final sequence: the cache held no stale entry.
    old, new = model(1, vocab=12), model(2, vocab=12)
    engine = TorchEngine(old, 2, 0, temperature=1.0, seed=3, version=0, inflight=mode)
    out = engine.generate([PROMPT, [1, 7, 8]], 16, 8, weight_source=swap_after(2, 1, new))
    stats = engine.stats()
    assert stats["verify/wasted_tokens"] > 0, "no row was cut; the test would prove nothing"
    in_flight = 0
    for prompt, group in zip([PROMPT, [1, 7, 8]], out, strict=True):
        for r in group:
            # A row that ended before the swap is a finished sample of the old weights.
            versions = set(r.token_versions.tolist())
            assert versions in ({0}, {1})
            weights = new if versions == {1} else old
            in_flight += versions == {1}
            seq = torch.tensor([prompt + r.token_ids.tolist()])
            with torch.no_grad():
                lp = token_logprobs(weights(seq)[:, :-1], seq[:, 1:], 1.0)[0, len(prompt) - 1 :]
            np.testing.assert_allclose(r.behaviour_logprobs, lp.numpy(), atol=1e-4)
    assert in_flight > 16


def test_kept_weights_are_released():
    old, new = model(1), model(2)
    engine, _ = sample("verify_on_finish", old, new, rows=16, max_new=4)
    assert engine.swapper.kept == {}
    assert engine.version == 1 and engine.model is not old


def test_load_weights_between_calls_after_an_in_flight_swap():
    # The model built during a swap must accept an ordinary load afterwards.
    old, new = model(1), model(2)
    engine, _ = sample("verify_on_swap", old, new, rows=8, max_new=3)
    engine.load_weights(2, model(3).state_dict())
    engine.generate([PROMPT], 4, 3, weight_source=swap_after(1, 3, model(4)))
    engine.load_weights(4, model(5).state_dict())
    assert engine.version == 4


def test_old_version_tokens_in_some_rows_only_are_scored_by_that_rows_old_model():
    """Regression: rows whose tokens come from an old version were scored by indexing the old
    model's output (which holds only those rows) with their row numbers in the whole batch."""
    from actors.decoding.inflight import verify_rows
    from testing.models import random_model

    new, old = (random_model(12, s, intermediate_size=64, num_hidden_layers=1) for s in (0, 1))
    prompts = [[1, 2], [1, 3], [1, 4], [1, 5]]
    tokens = [[6, 7], [7, 8], [8, 9], [9, 6]]
    versions = [[1, 1], [1, 1], [1, 1], [0, 0]]  # only the last row has old-version tokens
    out = verify_rows(new, 1, {0: old}, prompts, tokens, versions, 1.0, 1.0, None, None, False, 0)
    assert out.accepted[:3] == [2, 2, 2]  # tokens of the new version: kept with probability 1
    assert len(out.tokens) == 4


def test_verification_in_row_chunks_is_exact(monkeypatch):
    # A real vocabulary makes the [rows, tokens + 1, V] scores large, so rows are verified a few
    # at a time; chunks of 500 rows here (the same bound, scaled to this vocabulary).
    from actors.engines.torch import swap

    calls = []
    real = swap.verify_rows

    def counted(*args, **kwargs):
        calls.append(len(args[3]))
        return real(*args, **kwargs)

    monkeypatch.setattr(swap, "VERIFY_SCORE_BYTES", 2 * 6 * 4 * 500)
    monkeypatch.setattr(swap, "verify_rows", counted)
    old, new = model(1), model(2)
    engine, out = sample("verify_on_swap", old, new, rows=8000, max_new=3)
    assert len(calls) == 16 and set(calls) == {500}
    assert pvalue_against(new, out, 3) > 0.01
    assert 0 < engine.stats()["verify/salvaged_frac"] < 1


def test_a_weight_source_that_raises_leaves_the_engine_reusable():
    # The actor's stop: its weight source raises between decoding steps; the call unwinds, the
    # rows' cache blocks are released, and the engine decodes again afterwards.
    class Stop(Exception):
        pass

    def stop_source():
        raise Stop

    engine = TorchEngine(model(1), NO_EOS, 0, temperature=1.0, seed=0, version=0)
    with pytest.raises(Stop):
        engine.generate([PROMPT], 4, 5, weight_source=stop_source)
    out = engine.generate([PROMPT], 4, 5)[0]
    assert [len(r.token_ids) for r in out] == [5, 5, 5, 5]

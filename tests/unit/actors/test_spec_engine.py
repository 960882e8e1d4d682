"""Self-speculative decoding in the torch engine is lossless: greedy outputs equal plain greedy
decoding, and sampled complete sequences follow the plain sampling distribution."""

from __future__ import annotations

import pytest
import torch

from actors.engines.torch.engine import TorchEngine
from common.config.actor import SpecConfig
from testing.lossless_check import (
    EOS,
    exact_sequence_logprobs,
    greedy_matches_plain,
    peaky_model,
    rollouts_pvalue,
    sampled_pvalue,
)

METHODS = [
    SpecConfig(method="none"),
    SpecConfig(method="early_exit", k=3, exit_layer=1, adaptive=False),
    SpecConfig(method="early_exit", k=2, exit_layer=2, adaptive=False),
    SpecConfig(method="ngram", k=3, ngram_max_n=2, ngram_min_n=1, adaptive=False),
]


@pytest.mark.parametrize("spec", METHODS, ids=lambda s: f"{s.method}-k{s.k}-e{s.exit_layer}")
def test_greedy_speculative_equals_greedy_plain(spec):
    stats, tokens = greedy_matches_plain(spec)
    if spec.method != "none":
        assert stats["spec/acceptance_rate"] > 0, stats
        assert stats["actor/forward_passes"] < tokens


@pytest.mark.parametrize("spec", METHODS, ids=lambda s: f"{s.method}-k{s.k}-e{s.exit_layer}")
@pytest.mark.parametrize(("temperature", "top_p"), [(1.3, 1.0), (0.7, 0.9)])
def test_sampled_sequences_follow_plain_distribution(spec, temperature, top_p):
    p_value, acceptance = sampled_pvalue(spec, temperature, top_p)
    assert p_value > 1e-3, f"{spec.method}: p = {p_value:.2e}"
    if spec.method != "none":
        assert acceptance > 0.05


def test_statistical_check_detects_a_different_distribution():
    # Negative control: the same check rejects samples from other weights.
    prompt, max_new = [1, 4, 5, 4], 3
    model = peaky_model(vocab=6, seed=1, scale=8.0)
    other = peaky_model(vocab=6, seed=2, scale=8.0)
    exact = exact_sequence_logprobs(model, prompt, max_new, 1.3, 1.0, EOS)
    rollouts = TorchEngine(other, EOS, 0, 1.3, seed=5).generate([prompt], 6000, max_new)[0]
    assert rollouts_pvalue(exact, rollouts) < 1e-6


def test_every_outcome_enumerated_once():
    model = peaky_model(vocab=4, seed=0, scale=1.0)
    exact = exact_sequence_logprobs(model, [1], 2, 1.0, 1.0, EOS)
    # Length-1 outputs end in EOS; length-2 outputs are any non-EOS first token then any token.
    assert len(exact) == 1 + 3 * 4
    assert sum(torch.tensor(list(exact.values())).exp()) == pytest.approx(1.0, abs=1e-5)
    assert all(k[-1] == EOS or len(k) == 2 for k in exact)

"""Self-speculative decoding in the torch engine is lossless: greedy outputs equal plain greedy
decoding, and sampled complete sequences follow the plain sampling distribution."""

from __future__ import annotations

import pytest
import torch

from actors.engines.torch_engine import TorchEngine
from common.config.actor import SpecConfig
from testing.lossless_check import (
    exact_sequence_logprobs,
    peaky_model,
    rollouts_pvalue,
    sequence_pvalue,
)

EOS = 2
METHODS = [
    SpecConfig(method="none"),
    SpecConfig(method="early_exit", k=3, exit_layer=1),
    SpecConfig(method="early_exit", k=2, exit_layer=2),
    SpecConfig(method="ngram", k=3, ngram_max_n=2, ngram_min_n=1),
]


def greedy_matches_plain(spec: SpecConfig) -> tuple[dict[str, float], int]:
    """Greedy decoding with ``spec`` gives plain greedy decoding's outputs, token for token, on
    two calls in a row (the second also drafts from earlier completions of the same prompts).
    Returns the speculative engine's stats and the tokens of its last call."""
    model = peaky_model(vocab=16, seed=0, scale=30.0)
    prompts = [[1, 5, 6, 5, 6], [1, 7], [1, 8, 9, 8, 9, 8, 9], [1, 3]]
    plain = TorchEngine(model, EOS, 0, temperature=0.0).generate(prompts, 2, 12)
    engine = TorchEngine(model, EOS, 0, temperature=0.0, spec=spec)
    for _ in range(2):
        fast = engine.generate(prompts, 2, 12)
        for group_plain, group_fast in zip(plain, fast, strict=True):
            for a, b in zip(group_plain, group_fast, strict=True):
                assert a.token_ids.tolist() == b.token_ids.tolist()
                assert a.finished == b.finished
    return engine.stats(), sum(len(r.token_ids) for g in fast for r in g)


def sampled_pvalue(spec: SpecConfig, temperature: float, top_p: float) -> tuple[float, float]:
    """Chi-square p-value of 6,000 complete sequences sampled with ``spec`` against the exact
    plain distribution, and the engine's draft acceptance rate."""
    model = peaky_model(vocab=6, seed=1, scale=8.0)
    engine = TorchEngine(model, EOS, 0, temperature, top_p, seed=123, spec=spec)
    p_value = sequence_pvalue(engine, [1, 4, 5, 4], max_new=3, samples=6000)
    return p_value, engine.stats().get("spec/acceptance_rate", 0.0)


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

"""The trained self-draft in the torch engine: exact (chi-square against the enumerated plain
distribution, with a negative control that breaks the draft's q), greedy-identical, and its
cached drafts equal a fresh forward of the adapter over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from actors.decoding.early_exit import EarlyExitDrafter
from actors.decoding.paged_cache import PagedKVCache
from actors.engines.torch.engine import TorchEngine
from common.config.actor import SpecConfig
from common.layers import KVCache
from testing.lossless_check import (
    ADAPTER_VOCAB,
    EOS,
    greedy_matches_plain,
    peaky_model,
    sampled_pvalue,
    sequence_pvalue,
    with_adapter,
)
from testing.models import random_model

ADAPTER_SPECS = [
    SpecConfig(method="early_exit", k=3, exit_layer=1, adapter=True, adaptive=False),
    SpecConfig(method="hybrid", k=2, exit_layer=2, adapter=True, adaptive=False),
]


@pytest.mark.parametrize("spec", ADAPTER_SPECS, ids=lambda s: f"{s.method}-k{s.k}")
def test_adapter_greedy_equals_plain(spec):
    stats, tokens = greedy_matches_plain(spec)
    assert stats["spec/acceptance_rate"] > 0
    assert stats["actor/forward_passes"] < tokens


@pytest.mark.parametrize(
    ("spec", "temperature", "top_p"),
    [(ADAPTER_SPECS[0], 1.3, 1.0), (ADAPTER_SPECS[0], 0.7, 0.9), (ADAPTER_SPECS[1], 1.3, 1.0)],
    ids=["early_exit-t1.3", "early_exit-t0.7-p0.9", "hybrid-t1.3"],
)
def test_adapter_samples_follow_plain_distribution(spec, temperature, top_p):
    p_value, acceptance = sampled_pvalue(spec, temperature, top_p)
    assert p_value > 1e-3, f"p = {p_value:.2e}"
    assert 0.05 < acceptance < 1.0  # drafts are accepted and rejected


def test_adapter_refill_mid_rollout_is_exact():
    # Continuous batching: 4 rows at most for 12 completions, so rows join mid-rollout and
    # their prompts' adapter KV is written by the prefill of a running batch.
    spec = ADAPTER_SPECS[0]
    model = with_adapter(peaky_model(vocab=6, seed=1, scale=8.0), spec, ADAPTER_VOCAB)
    engine = TorchEngine(model, EOS, 0, 1.3, seed=11, spec=spec, max_rows=4)
    assert sequence_pvalue(engine, [1, 4, 5, 4], max_new=3, samples=6000) > 1e-3


def test_negative_control_a_wrong_draft_q_is_detected(monkeypatch):
    # Report a q that is not the one the drafts were sampled from (uniform over the draft
    # vocabulary): the rejection sampler's output is then biased, and the check must see it.
    spec = ADAPTER_SPECS[0]
    model = with_adapter(peaky_model(vocab=6, seed=1, scale=8.0), spec, ADAPTER_VOCAB)
    real = EarlyExitDrafter._draft_logprobs

    def wrong(self, *args, **kwargs):
        tokens, q = real(self, *args, **kwargs)
        uniform = torch.where(torch.isfinite(q), -torch.log(torch.tensor(len(ADAPTER_VOCAB))), q)
        return tokens, uniform

    monkeypatch.setattr(EarlyExitDrafter, "_draft_logprobs", wrong)
    engine = TorchEngine(model, EOS, 0, 1.3, seed=123, spec=spec)
    assert sequence_pvalue(engine, [1, 4, 5, 4], max_new=3, samples=6000) < 1e-4


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_cached_adapter_drafts_equal_a_fresh_forward(cache_kind):
    model = random_model(40, 3, num_hidden_layers=3)
    spec = SpecConfig(method="early_exit", exit_layer=1, adapter=True)
    with_adapter(model, spec, list(range(0, 40, 3)))
    model.eval()
    seq = torch.tensor([[5, 9, 11, 3, 7, 21, 33, 2, 8]])
    T = seq.shape[1]
    with torch.no_grad():
        h_exit = model.run_layers(model.model.embed_tokens(seq), None, None, 0, 1)
        fresh = model.run_draft(h_exit, None, None)  # [1, T, V_draft], causal, no cache
        if cache_kind == "paged":
            cache = PagedKVCache(model.args, 4, torch.device("cpu"), torch.float32)
            cache.reserve(0, T)
            cache = cache.bind([0])
        else:
            cache = KVCache(model.args, 1, T)
        cache.draft_kv = True
        # A full forward over the first 5 tokens writes the adapter's KV (the prefill path) ...
        model(seq[:, :5], torch.arange(5)[None], cache)
        # ... then the drafter's path, one token at a time.
        for t in range(5, T):
            pos = torch.tensor([[t]])
            h = model.run_layers(model.model.embed_tokens(seq[:, t : t + 1]), pos, cache, 0, 1)
            step = model.run_draft(h, pos, cache)
            torch.testing.assert_close(step[0, 0], fresh[0, t], atol=1e-4, rtol=1e-4)


def test_adapter_is_small_for_the_preset_shape():
    from common.model import Transformer, attach_draft
    from common.model_args import ModelArgs
    from testing.shapes import SMOLLM2_135M

    smollm2 = ModelArgs(**SMOLLM2_135M)
    with torch.device("meta"):
        model = Transformer(smollm2)
        attach_draft(model, 6)  # the vocabulary ids are a buffer, not parameters
    draft = sum(p.numel() for p in model.draft.parameters())
    policy = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("draft."))
    assert draft / policy < 0.05, draft / policy


def test_engine_refuses_adapter_without_one():
    model = random_model(16, 0, num_hidden_layers=3)
    spec = SpecConfig(method="early_exit", exit_layer=1, adapter=True)
    with pytest.raises(ValueError, match="no draft adapter"):
        TorchEngine(model, EOS, 0, spec=spec)


def test_adapter_drafts_from_adopted_inference_tensors():
    """A version adopted mid-generate (inside inference mode, as a swap does) has inference
    tensors as parameters (no version counter): the adapter's cached head rows follow them."""
    spec = ADAPTER_SPECS[0]
    model = with_adapter(peaky_model(vocab=16, seed=0, scale=30.0), spec, ADAPTER_VOCAB)
    engine = TorchEngine(model, EOS, 0, temperature=1.0, spec=spec)
    engine.generate([[1, 5, 6]], 2, 6)
    with torch.inference_mode():  # as a version fetched and applied mid-generate
        published = {k: v.clone() for k, v in model.state_dict().items()}
        published["lm_head.weight"].mul_(-1.0)  # another head: the old rows must not be reused
        engine.load_weights(1, published)
    assert engine.model is not model and engine.model.lm_head.weight.is_inference()
    out = engine.generate([[1, 5, 6]], 2, 6)
    assert all(len(r.token_ids) > 0 for g in out for r in g)
    rows = engine.model.draft.head_weight(engine.model.lm_head.weight)
    expected = published["lm_head.weight"].index_select(0, engine.model.draft.vocab_ids)
    assert torch.equal(rows, expected)

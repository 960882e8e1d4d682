"""The EAGLE-3 head's warm start sampling with vLLM (learner/prepare/vllm_sample.py): its
completions follow the policy's exact law at the run's temperature (chi-square, with a control
at another temperature that must fail), end at EOS included, and ``--sampler`` picks vLLM only
where it may."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.model import save_pretrained
from learner.prepare.draft_data import Decoding, WarmDraftError, resolve_sampler
from learner.prepare.vllm_sample import sample_vllm, why_not_vllm
from testing.lossless_check import EOS, exact_sequence_logprobs, peaky_model, rollouts_pvalue
from testing.models import random_model

PROMPT, NEW, T = [1, 4, 5, 4], 3, 0.8


def test_vllm_samples_follow_the_policys_law_and_end_at_eos(tmp_path):
    model = peaky_model(6, 3, 6.0)
    save_pretrained(model, tmp_path)
    decoding = Decoding(NEW, 1, EOS, T, 1.0)
    (group,) = sample_vllm(tmp_path, [PROMPT], 3000, decoding, seed=0, dtype="float32")
    assert len(group) == 3000 and all(p == PROMPT for p, _ in group)
    completions = [c for _, c in group]
    assert all(1 <= len(c) <= NEW for c in completions)
    short = [c for c in completions if len(c) < NEW]
    assert short and all(c[-1] == EOS for c in short)  # EOS ends a completion, included
    assert all(EOS not in c[:-1] for c in completions)
    rollouts = [SimpleNamespace(token_ids=torch.tensor(c)) for c in completions]

    def law(temperature: float) -> dict:
        return exact_sequence_logprobs(model, PROMPT, NEW, temperature, 1.0, EOS)

    assert rollouts_pvalue(law(T), rollouts) >= 0.01
    assert rollouts_pvalue(law(0.5), rollouts) < 0.01  # the control: another temperature


def test_the_sampler_is_vllm_only_for_the_head_and_only_where_vllm_serves_the_model(tmp_path):
    served, small = tmp_path / "served", tmp_path / "small"
    save_pretrained(random_model(64, 0), served)
    save_pretrained(random_model(64, 0, hidden_size=32, num_attention_heads=4), small)
    assert why_not_vllm(served) is None
    assert "head dimension 8" in why_not_vllm(small)
    assert "config.json" in why_not_vllm(tmp_path / "missing")
    assert resolve_sampler("auto", True, served) == "vllm"
    assert resolve_sampler("auto", True, small) == "torch"
    assert resolve_sampler("auto", False, served) == "torch"
    assert resolve_sampler("torch", True, served) == "torch"
    with pytest.raises(WarmDraftError, match="EAGLE-3 head only"):
        resolve_sampler("vllm", False, served)
    with pytest.raises(WarmDraftError, match="head dimension"):
        resolve_sampler("vllm", True, small)
    with pytest.raises(WarmDraftError, match="--sampler must be one of"):
        resolve_sampler("fast", True, served)

"""Delayed verification on vLLM at Qwen's 151,936-token vocabulary: the record kept per in-flight
token is bounded (top K + the sampled token), verification runs through a swap, and every kept
token carries the new version. A randomly initialised model with a few small layers is enough."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.engines.vllm_verify import verified_token_distribution
from common.config.actor import EngineConfig
from common.model import save_pretrained
from testing.models import random_model

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from actors.engines.vllm_engine import VllmEngine  # noqa: E402

VOCAB = 151_936


def swapping_engine(path, **sampling):
    """A verify_on_swap engine (top 8 recorded) on version 0 of a random model at VOCAB, and a
    weight source that hands it version 1 at its fourth poll."""
    old, new = (random_model(VOCAB, seed, max_position_embeddings=64) for seed in (0, 1))
    save_pretrained(old, path)
    engine = VllmEngine(
        path,
        -1,
        EngineConfig(vllm_max_model_len=64, vllm_verify_topk=8),
        inflight="verify_on_swap",
        seed=0,
        version=0,
        **sampling,
    )
    calls = {"n": 0}

    def source():
        calls["n"] += 1
        return (1, new.state_dict()) if calls["n"] == 4 else None

    return engine, source


def test_record_is_bounded_at_real_vocabulary(tmp_path):
    engine, source = swapping_engine(tmp_path)
    out = engine.generate([[1, 5, 6, 7], [1, 9]], 4, 8, weight_source=source)
    stats = engine.stats()
    assert stats["verify/inflight_tokens"] > 0
    # K = 8: at most 9 (id int32, log-prob fp32) pairs; the whole vocabulary would be 594 KiB.
    assert 0 < stats["verify/record_bytes_per_token"] <= 9 * 8
    assert all(set(r.token_versions.tolist()) == {1} for g in out for r in g)
    assert all(len(r.token_ids) == 8 for g in out for r in g)


def test_verify_at_temperature_and_top_p_scores_a_bounded_top_k(tmp_path):
    # Processing (temperature 0.7, top-p 0.9) cannot use vLLM's raw top K as they are, so the
    # swap's scoring reads SCORE_TOPK raw log-probs per token and processes them here: never
    # the whole vocabulary as Python objects (32 rows x 8 tokens x 151,936 entries would be GBs).
    import resource

    from actors.engines.vllm_engine import SCORE_TOPK

    engine, source = swapping_engine(tmp_path, temperature=0.7, top_p=0.9)
    assert engine.score_topk == SCORE_TOPK < 1024
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    out = engine.generate([[1, 5, 6, 7], [1, 9]], 16, 8, weight_source=source)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    stats = engine.stats()
    assert stats["verify/inflight_tokens"] > 0
    assert 0 < stats["verify/record_bytes_per_token"] <= 9 * 8
    assert grown_mib < 400, f"peak memory grew {grown_mib:.0f} MiB during the swap"
    assert all(set(r.token_versions.tolist()) == {1} for g in out for r in g)


def test_residual_is_exact_with_whole_records_and_close_with_top_k():
    torch.manual_seed(1)
    p = torch.log_softmax(torch.randn(50) * 2, 0)
    q = torch.log_softmax(p + torch.randn(50) * 0.5, 0)
    exact = verified_token_distribution(p, q, -1)
    np.testing.assert_allclose(exact.numpy(), p.double().exp().numpy(), atol=1e-6)
    tv = {
        k: 0.5 * float((verified_token_distribution(p, q, k) - p.double().exp()).abs().sum())
        for k in (2, 8, 32)
    }
    assert tv[32] < tv[2] and tv[32] < 0.01
    # Negative control: resampling from p at a rejection (SPEC-RL's shortcut) is measurably off.
    pp, qq = p.double().exp(), q.double().exp()
    overlap = torch.minimum(pp, qq)
    wrong = overlap + (1 - overlap.sum()) * pp
    assert 0.5 * float((wrong - pp).abs().sum()) > 10 * tv[32]

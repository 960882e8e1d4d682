"""Delayed verification on vLLM at Qwen's 151,936-token vocabulary: the record kept per in-flight
token is bounded (top K + the sampled token), verification runs through a swap, and every kept
token carries the new version. A randomly initialised model with a few small layers is enough."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.engines.vllm.engine import VllmEngine
from actors.engines.vllm.verify import verified_token_distribution
from common.config.actor import EngineConfig
from common.model import save_pretrained
from testing.models import random_model

pytestmark = pytest.mark.vllm

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


def test_verify_at_temperature_and_top_p_keeps_the_python_side_bounded(tmp_path):
    # Processing (temperature 0.7, top-p 0.9) runs over the whole vocabulary in tensors inside
    # the model runner; only the top K and the scored token come back per position, never the
    # whole vocabulary as Python objects (32 rows x 8 tokens x 151,936 entries would be GBs).
    import resource

    engine, source = swapping_engine(tmp_path, temperature=0.7, top_p=0.9)
    assert engine.score_processed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    out = engine.generate([[1, 5, 6, 7], [1, 9]], 16, 8, weight_source=source)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    stats = engine.stats()
    assert stats["verify/inflight_tokens"] > 0
    assert 0 < stats["verify/record_bytes_per_token"] <= 9 * 8
    assert grown_mib < 400, f"peak memory grew {grown_mib:.0f} MiB during the swap"
    assert all(set(r.token_versions.tolist()) == {1} for g in out for r in g)


def test_scoring_is_the_whole_vocabulary_processed_distribution(tmp_path):
    # A broad distribution over 4,096 tokens (a randomly initialised model is near uniform):
    # at temperature 0.7 / top-p 0.9 the nucleus holds thousands of tokens, so processing only
    # the top 64 raw log-probs (the scoring before this rule) overstates every head token's
    # probability and scores nucleus tokens outside those 64 as impossible. The new policy's
    # record must be the exact processed distribution over the whole vocabulary.
    from actors.engines.vllm.engine import _Slot
    from common.sampling import processed_logprobs

    vocab, temperature, top_p, k = 4096, 0.7, 0.9, 8
    model = random_model(vocab, 0, max_position_embeddings=64)
    save_pretrained(model, tmp_path)
    engine = VllmEngine(
        tmp_path,
        -1,
        EngineConfig(vllm_max_model_len=64, vllm_verify_topk=k),
        inflight="verify_on_swap",
        temperature=temperature,
        top_p=top_p,
        seed=0,
        version=0,
    )
    prompt = [1, 5, 6, 7]
    # Stale tokens: the raw argmax, then raw ranks 500 and 2000 (inside the nucleus, outside
    # the top 64), alternately, chosen against the model's own forward.
    tokens: list[int] = []
    for i in range(6):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens]))[0, -1]
        tokens.append(int(logits.argsort(descending=True)[(0, 500, 2000)[i % 3]]))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1]
    exact = processed_logprobs(logits, temperature, top_p)
    raw = torch.log_softmax(logits, -1)
    top64 = raw.topk(64, -1)
    truncated = torch.full_like(raw, float("-inf")).scatter(
        -1, top64.indices, processed_logprobs(top64.values, temperature, top_p)
    )

    _, (records,) = engine._score([_Slot(prompt, tokens=tokens)])
    for i, (token, (ids, lps)) in enumerate(zip(tokens, records, strict=True)):
        reference = exact[i, torch.from_numpy(ids.astype(np.int64))].numpy()
        np.testing.assert_allclose(lps, reference, atol=2e-4)
        assert token in ids.tolist()
        assert len(ids) <= k + 1
        # The rest of the record is the top K of the exact distribution (up to float rounding).
        others = lps[ids != token]
        assert len(others) >= k - 1
        assert others.min() >= float(exact[i].topk(k).values[-1]) - 2e-4
        # The truncated scoring is wrong on this case, by far more than the tolerance.
        assert abs(float(truncated[i, token]) - float(exact[i, token])) > 0.5
        assert torch.isfinite(exact[i, token])


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

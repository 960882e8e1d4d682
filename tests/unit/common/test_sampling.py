"""The processed sampling distribution (temperature, top-p) shared by actors and learner."""

import math

import torch

from common.sampling import processed_logprobs, sample_tokens
from testing.models import token_logprobs


def test_temperature_only_is_scaled_softmax():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    got = processed_logprobs(logits, temperature=0.5)
    torch.testing.assert_close(got, torch.log_softmax(logits / 0.5, -1))


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    got = processed_logprobs(logits, 1.0, top_p=0.8).exp()
    # 0.5 < 0.8, 0.5 + 0.3 = 0.8 reaches p: keep the first two, renormalised.
    torch.testing.assert_close(got, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    got = processed_logprobs(logits, 1.0, top_p=0.81).exp()
    assert (got[0, :3] > 0).all() and got[0, 3] == 0
    # The most likely token always survives.
    assert processed_logprobs(logits, 1.0, top_p=0.01).exp()[0, 0] == 1.0


def test_sample_tokens_returns_logprob_of_drawn_token():
    lp = processed_logprobs(torch.randn(64, 10), 0.7, 0.9)
    tokens, token_lp = sample_tokens(lp, torch.Generator().manual_seed(0))
    assert torch.isfinite(token_lp).all()  # never a token outside the nucleus
    torch.testing.assert_close(token_lp, lp.gather(-1, tokens[:, None]).squeeze(-1))


def test_sampling_frequencies_follow_processed_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    lp = processed_logprobs(logits[None].expand(20000, -1), 1.3, 0.9)
    tokens, _ = sample_tokens(lp, torch.Generator().manual_seed(1))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    expected = lp[0].exp()
    # 20k draws: standard error <= 0.0036 per cell; 5 sigma.
    assert torch.allclose(freq, expected, atol=0.018), (freq, expected)


def test_token_logprobs_gathers():
    logits = torch.randn(2, 3, 5)
    tokens = torch.randint(0, 5, (2, 3))
    got = token_logprobs(logits, tokens, 2.0)
    assert math.isclose(
        float(got[1, 2]),
        float(torch.log_softmax(logits[1, 2] / 2.0, -1)[tokens[1, 2]]),
        rel_tol=1e-6,
    )


def test_temperature_zero_is_greedy_one_hot():
    logits = torch.tensor([[0.1, 3.0, -2.0], [5.0, 1.0, 4.9]])
    lp = processed_logprobs(logits, 0.0)
    assert lp.exp().tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    tokens, token_lp = sample_tokens(lp)
    assert tokens.tolist() == [1, 0] and token_lp.tolist() == [0.0, 0.0]

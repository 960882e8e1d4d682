"""GRPO advantages and the PPO-clip loss against slow references written in the papers' notation."""

import math

import pytest
import torch

from learner.loss import grpo_advantages, ppo_clip_loss


def slow_grpo(rewards: list[list[float]], eps: float = 1e-6) -> list[list[float]]:
    out = []
    for group in rewards:
        mu = sum(group) / len(group)
        sigma = math.sqrt(sum((r - mu) ** 2 for r in group) / len(group))
        out.append([(r - mu) / (sigma + eps) for r in group])
    return out


def slow_ppo(logp, behav, adv, mask, eps_clip, cap, ref=None, kl_coef=0.0):
    """Per token: rho = pi/mu; s = min(rho A, clip(rho) A); for A < 0, s = max(s, c A);
    loss = -mean(s) over generated tokens, + k3 KL."""
    total, kl_total, n = 0.0, 0.0, 0
    for b in range(len(logp)):
        for t in range(len(logp[b])):
            if not mask[b][t]:
                continue
            rho = math.exp(logp[b][t] - behav[b][t])
            clipped = min(max(rho, 1 - eps_clip), 1 + eps_clip)
            s = min(rho * adv[b], clipped * adv[b])
            if adv[b] < 0:
                s = max(s, cap * adv[b])
            total += -s
            if ref is not None:
                d = ref[b][t] - logp[b][t]
                kl_total += math.exp(d) - d - 1
            n += 1
    return total / n + kl_coef * kl_total / n


def test_grpo_matches_reference():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(5, 8, generator=g)
    rewards[2] = 1.0  # a group with no signal
    expected = torch.tensor(slow_grpo(rewards.tolist()))
    got = grpo_advantages(rewards)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.all(got[2] == 0)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_ppo_clip_matches_reference(kl_coef):
    g = torch.Generator().manual_seed(1)
    B, T = 4, 6
    logp = -torch.rand(B, T, generator=g) * 3
    behav = logp + (torch.rand(B, T, generator=g) - 0.5) * 3  # ratios inside and outside the clip
    ref = logp + (torch.rand(B, T, generator=g) - 0.5)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    out = ppo_clip_loss(logp, behav, adv, mask, 0.2, 2.0, ref_logprobs=ref, kl_coef=kl_coef)
    expected = slow_ppo(
        logp.tolist(), behav.tolist(), adv.tolist(), mask.tolist(), 0.2, 2.0, ref.tolist(), kl_coef
    )
    assert out.loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert 0 < out.clip_frac.item() < 1
    assert 0 < out.truncated_frac.item() < 1


def test_dual_clip_bounds_stale_negative_tokens():
    # A token now 50x likelier than when sampled, with a negative advantage: without truncation
    # the surrogate would be -50 |A|; the dual clip bounds it at -cap |A| and gives no gradient.
    logp = torch.tensor([[0.0]], requires_grad=True)
    behav = torch.tensor([[-math.log(50.0)]])
    out = ppo_clip_loss(logp, behav, torch.tensor([-1.0]), torch.ones(1, 1), 0.2, 3.0)
    assert out.pg_loss.item() == pytest.approx(3.0)
    out.loss.backward()
    assert logp.grad.item() == 0.0


def test_ppo_gradient_is_advantage_weighted_score_on_policy():
    # On-policy (theta = prox = behaviour) the gradient is -A * grad log pi / n_tokens.
    logits = torch.randn(2, 3, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, :1]  # [2, 1]
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 1)
    out = ppo_clip_loss(logp, logp.detach(), adv, mask, 0.2, 2.0)
    out.loss.backward()
    manual = torch.zeros(2, 3)
    p = torch.softmax(logits.detach(), -1)
    for b in range(2):
        onehot = torch.zeros(3)
        onehot[0] = 1
        manual[b] = -adv[b] * (onehot - p[b]) / 2
    torch.testing.assert_close(logits.grad, manual)

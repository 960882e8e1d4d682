"""GRPO advantages and the PPO-clip policy loss with truncated importance weights (pure functions).

Terms, defined once:
- ``behaviour_logprobs``: log pi_behaviour(y_t), recorded by the actor when it sampled y_t,
  possibly under an older policy version (asynchronous RL: groups arrive up to
  ``max_staleness`` versions late).
- ``ratio = pi_theta(y_t) / pi_behaviour(y_t)``: the importance ratio to the behaviour policy.
- PPO-clip surrogate: ``min(ratio A, clip(ratio, 1 - eps, 1 + eps) A)``. For ``A > 0`` it stops
  pushing once the ratio exceeds ``1 + eps``; for ``A < 0`` once it falls below ``1 - eps``.
- Truncated importance weight (dual clip, Ye et al. 2020): for ``A < 0`` the surrogate is bounded
  below by ``dual_clip * A``, so a stale token that the current policy now finds far more likely than
  its sampler did cannot dominate the update with an unbounded ratio.
- ``advantages``: GRPO, rewards normalised within the group of one prompt.

Design: docs/design.md §4.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages: rewards [N, G] -> (r - mean_g) / (std_g + eps), [N, G].

    A group whose completions all earn the same reward carries no signal and gets zero advantage.
    """
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


@dataclass
class PolicyLoss:
    loss: torch.Tensor
    """Scalar to minimise: policy surrogate + kl_coef * KL."""
    pg_loss: torch.Tensor
    kl: torch.Tensor
    clip_frac: torch.Tensor
    """Share of tokens where the clipped branch of the surrogate was taken."""
    truncated_frac: torch.Tensor
    """Share of tokens where the dual-clip bound (truncated importance weight) was active."""
    ratio_mean: torch.Tensor
    abs_log_ratio: torch.Tensor
    """Mean |log pi_theta - log pi_behaviour|: how far the behaviour policy is from the learner's."""


def ppo_clip_loss(
    logprobs: torch.Tensor,  # [B, T] log pi_theta(y_t), with grad
    behaviour_logprobs: torch.Tensor,  # [B, T]
    advantages: torch.Tensor,  # [B] one advantage per sequence
    mask: torch.Tensor,  # [B, T] 1 for generated tokens, 0 for padding
    clip_eps: float,
    dual_clip: float,
    ref_logprobs: torch.Tensor | None = None,  # [B, T] log pi_ref(y_t), for the KL penalty
    kl_coef: float = 0.0,
    num_tokens: float | torch.Tensor | None = None,
) -> PolicyLoss:
    """Token-mean PPO-clip loss on the ratio to the behaviour policy, dual-clipped at ``dual_clip``.

    ``num_tokens``: the denominator of every mean (default: ``mask.sum()``); a micro-batch passes
    the whole batch's count, so its terms add up to the one-batch values (learner/microbatch.py).
    """
    mask = mask.float()
    n_tokens = (mask.sum() if num_tokens is None else torch.as_tensor(num_tokens)).clamp(min=1.0)
    adv = advantages.detach().unsqueeze(-1)  # [B, 1]
    log_ratio = (logprobs - behaviour_logprobs).clamp(max=20.0)  # exp stays finite
    ratio = torch.exp(log_ratio)  # [B, T]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    surrogate = torch.minimum(unclipped, clipped)  # [B, T]
    truncated = (adv < 0) & (surrogate < dual_clip * adv)
    surrogate = torch.where(truncated, dual_clip * adv, surrogate)
    pg_loss = -(surrogate * mask).sum() / n_tokens

    if ref_logprobs is not None and kl_coef > 0:
        # k3 estimator of KL(pi_theta || pi_ref): exp(ref - theta) - (ref - theta) - 1 >= 0.
        delta = ref_logprobs.detach() - logprobs
        kl = ((torch.exp(delta) - delta - 1.0) * mask).sum() / n_tokens
    else:
        kl = torch.zeros((), device=logprobs.device)

    with torch.no_grad():
        clip_frac = ((clipped < unclipped).float() * mask).sum() / n_tokens
        truncated_frac = (truncated.float() * mask).sum() / n_tokens
        ratio_mean = (ratio * mask).sum() / n_tokens
        abs_lr = (log_ratio.abs() * mask).sum() / n_tokens

    return PolicyLoss(
        loss=pg_loss + kl_coef * kl,
        pg_loss=pg_loss.detach(),
        kl=kl.detach(),
        clip_frac=clip_frac,
        truncated_frac=truncated_frac,
        ratio_mean=ratio_mean,
        abs_log_ratio=abs_lr,
    )


def early_exit_kl(
    full_logprobs: torch.Tensor,  # [B, T, V] log p of the full model (processed, no top-p)
    exit_logprobs: torch.Tensor,  # [B, T, V] log q of the early exit, same processing
    mask: torch.Tensor,  # [B, T]
) -> torch.Tensor:
    """Draft co-training loss: token-mean KL(p_full || q_exit) with the full model's side detached.

    The gradient reaches the first E layers and the shared final norm and LM head, so the same
    optimizer step that moves the policy also pulls its own draft after it (and nudges the policy
    through the shared weights, as in LayerSkip); acceptance min(1, p/q) rises as q nears p.
    """
    p = full_logprobs.detach()
    kl = (p.exp() * (p - exit_logprobs)).sum(dim=-1)  # [B, T]
    mask = mask.float()
    return (kl * mask).sum() / mask.sum().clamp(min=1.0)

"""GRPO advantages and the PPO-clip policy loss with truncated importance weights (pure functions).

Terms, defined once:
- ``behaviour_logprobs``: log pi_behaviour(y_t), recorded by the actor when it sampled y_t (possibly
  under an older policy version).
- ``prox_logprobs``: log pi_prox(y_t), the learner's current policy before this optimizer step
  (detached). The decoupled PPO objective (Hilton et al., 2021) clips the ratio to pi_prox and
  corrects the behaviour/prox mismatch with an importance weight, which is what makes stale
  groups usable without letting one stale token blow up the update.
- ``is_weight = min(pi_prox / pi_behaviour, is_cap)``: truncated importance weight (detached).
- ``ratio = pi_theta / pi_prox``; the clipped surrogate is ``min(ratio A, clip(ratio) A)``.
- ``advantages``: GRPO, rewards normalised within the group of one prompt.
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
    """Share of tokens whose ratio left [1 - eps, 1 + eps] on the side that matters for A."""
    is_weight_mean: torch.Tensor
    is_truncated_frac: torch.Tensor
    """Share of tokens whose importance weight was capped."""
    abs_log_ratio_behaviour: torch.Tensor
    """Mean |log pi_prox - log pi_behaviour|: how far the behaviour policy was from the learner's."""


def ppo_clip_loss(
    logprobs: torch.Tensor,  # [B, T] log pi_theta(y_t), with grad
    prox_logprobs: torch.Tensor,  # [B, T] log pi_prox(y_t)
    behaviour_logprobs: torch.Tensor,  # [B, T]
    advantages: torch.Tensor,  # [B] one advantage per sequence
    mask: torch.Tensor,  # [B, T] 1 for generated tokens, 0 for padding
    clip_eps: float,
    is_cap: float,
    ref_logprobs: torch.Tensor | None = None,  # [B, T] log pi_ref(y_t), for the KL penalty
    kl_coef: float = 0.0,
) -> PolicyLoss:
    """Token-mean decoupled PPO-clip loss over all generated tokens of the batch."""
    mask = mask.float()
    n_tokens = mask.sum().clamp(min=1.0)
    prox = prox_logprobs.detach()
    adv = advantages.detach().unsqueeze(-1)  # [B, 1]

    ratio = torch.exp(logprobs - prox)  # [B, T]
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    surrogate = torch.minimum(ratio * adv, clipped * adv)  # [B, T]

    log_w = (prox - behaviour_logprobs).clamp(max=20.0)
    raw_w = torch.exp(log_w)
    is_weight = raw_w.clamp(max=is_cap).detach()  # [B, T]

    pg_loss = -(surrogate * is_weight * mask).sum() / n_tokens

    if ref_logprobs is not None and kl_coef > 0:
        # k3 estimator of KL(pi_theta || pi_ref): exp(ref - theta) - (ref - theta) - 1 >= 0.
        delta = ref_logprobs.detach() - logprobs
        kl = ((torch.exp(delta) - delta - 1.0) * mask).sum() / n_tokens
    else:
        kl = torch.zeros((), device=logprobs.device)

    with torch.no_grad():
        clip_frac = (((ratio - clipped).abs() > 0).float() * mask).sum() / n_tokens
        is_weight_mean = (is_weight * mask).sum() / n_tokens
        is_truncated_frac = ((raw_w > is_cap).float() * mask).sum() / n_tokens
        abs_lr = ((prox - behaviour_logprobs).abs() * mask).sum() / n_tokens

    return PolicyLoss(
        loss=pg_loss + kl_coef * kl,
        pg_loss=pg_loss.detach(),
        kl=kl.detach(),
        clip_frac=clip_frac,
        is_weight_mean=is_weight_mean,
        is_truncated_frac=is_truncated_frac,
        abs_log_ratio_behaviour=abs_lr,
    )


def early_exit_kl(
    full_logprobs: torch.Tensor,  # [B, T, V] log p of the full model (processed, no top-p)
    exit_logprobs: torch.Tensor,  # [B, T, V] log q of the early exit, same processing
    mask: torch.Tensor,  # [B, T]
) -> torch.Tensor:
    """Draft co-training loss: token-mean KL(p_full || q_exit) with the full model detached.

    Only the early exit learns from it (the target is detached), so the same optimizer step that
    moves the policy pulls its own draft after it; acceptance min(1, p/q) rises as q nears p.
    """
    p = full_logprobs.detach()
    kl = (p.exp() * (p - exit_logprobs)).sum(dim=-1)  # [B, T]
    mask = mask.float()
    return (kl * mask).sum() / mask.sum().clamp(min=1.0)

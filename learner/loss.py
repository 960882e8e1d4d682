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
- Truncated importance sampling (TIS, ``tis_cap`` C > 0): every token's surrogate is multiplied
  by the detached factor ``min(1, C / ratio)``, so where the unclipped branch is taken its value
  is ``min(ratio, C) * A`` and its gradient ``min(ratio, C) * A * grad log pi_theta``: the
  policy gradient with importance weights to the behaviour policy truncated at C (Ionides 2008;
  the rollout-training mismatch fix of Yao et al. 2025, whose weight pi_old / pi_rollout is
  this ratio at a step's first update, since the ratio's denominator here already is the
  behaviour log-prob). It differs from the dual clip in two ways: it acts on either sign of A,
  and a capped token keeps a gradient (weight C), whereas a dual-clipped token's term is the
  constant ``dual_clip * A`` (no gradient). With C < dual_clip the dual clip never binds.

Algorithm options (``LossOptions``; docs/configuration.md, Algorithms):
- ``clip_high``: the ratio is clipped to [1 - eps, 1 + clip_high] (clip-higher, DAPO).
- ``ratio_level="sequence"`` (GSPO): each token's ratio is its sequence's,
  ``exp(mean_t(log pi_theta - log pi_behaviour))`` over the sequence's tokens (gradient through
  the mean), so the clip acts per sequence; GSPO clips with eps near 3e-4 / 4e-4.
- ``aggregation``: ``token_mean`` (sum over tokens / tokens of the batch), ``seq_mean`` (each
  token's term over (its sequence's length x sequences)), ``seq_sum`` (Dr.GRPO: sum over tokens
  / (sequences x ``agg_tokens``)). The KL term is aggregated the same way.

Design: docs/design.md §4.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.config.field_types import LossAggregation, RatioLevel


def grpo_advantages(
    rewards: torch.Tensor, eps: float = 1e-6, std_norm: bool = True
) -> torch.Tensor:
    """Group-normalised advantages: rewards [N, G] -> (r - mean_g) / (std_g + eps), [N, G];
    without ``std_norm`` (Dr.GRPO) r - mean_g.

    A group whose completions all earn the same reward carries no signal and gets zero advantage.
    """
    mean = rewards.mean(dim=-1, keepdim=True)
    if not std_norm:
        return rewards - mean
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


@dataclass(frozen=True)
class LossOptions:
    """The algorithm options of :func:`ppo_clip_loss` (module docstring); the defaults are GRPO."""

    clip_high: float | None = None
    """Upper clip of the ratio; None: ``clip_eps``."""
    ratio_level: RatioLevel = "token"
    aggregation: LossAggregation = "token_mean"
    agg_tokens: float = 1.0
    """The constant length of ``aggregation="seq_sum"``."""
    tis_cap: float = 0.0
    """Cap C of the truncated importance weight; 0: off."""


@dataclass
class Sequences:
    """Which sequence each token belongs to, for the options that need sequences (a micro-batch
    passes the whole batch's ``count``, like ``num_tokens``)."""

    ids: torch.Tensor
    """[B, T] int64: the sequence index of each token."""
    lengths: torch.Tensor
    """[B, T]: the length (completion tokens) of each token's sequence."""
    count: float | torch.Tensor
    """Sequences of the whole batch."""

    @staticmethod
    def rows(mask: torch.Tensor) -> Sequences:
        """Each row one sequence, its length its mask's sum."""
        b, t = mask.shape
        ids = torch.arange(b, device=mask.device)[:, None].expand(b, t)
        lengths = mask.float().sum(-1, keepdim=True).expand(b, t)
        return Sequences(ids, lengths, float(b))


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
    options: LossOptions | None = None,
    sequences: Sequences | None = None,
) -> PolicyLoss:
    """PPO-clip loss on the ratio to the behaviour policy, dual-clipped at ``dual_clip``;
    token-mean unless ``options`` say otherwise (module docstring).

    ``num_tokens``: the denominator of every token mean (default: ``mask.sum()``); a micro-batch
    passes the whole batch's count, so its terms add up to the one-batch values
    (learner/microbatch.py). ``sequences``: each token's sequence (default: each row one), for
    ``ratio_level="sequence"`` and the sequence aggregations.
    """
    opts = options or LossOptions()
    mask = mask.float()
    n_tokens = (mask.sum() if num_tokens is None else torch.as_tensor(num_tokens)).clamp(min=1.0)
    adv = advantages.detach().unsqueeze(-1)  # [B, 1]
    log_ratio = (logprobs - behaviour_logprobs).clamp(max=20.0)  # exp stays finite
    seqs = sequences
    if seqs is None and (opts.ratio_level == "sequence" or opts.aggregation != "token_mean"):
        seqs = Sequences.rows(mask)
    if opts.ratio_level == "sequence":
        assert seqs is not None
        log_ratio = _sequence_log_ratio(log_ratio, mask, seqs.ids)
    ratio = torch.exp(log_ratio)  # [B, T]
    high = clip_eps if opts.clip_high is None else opts.clip_high
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high) * adv
    surrogate = torch.minimum(unclipped, clipped)  # [B, T]
    if opts.tis_cap > 0:
        surrogate = surrogate * (opts.tis_cap / ratio.detach()).clamp(max=1.0)
    truncated = (adv < 0) & (surrogate < dual_clip * adv)
    surrogate = torch.where(truncated, dual_clip * adv, surrogate)
    weights = _token_weights(opts, seqs)
    pg_loss = -_aggregate(surrogate, mask, n_tokens, weights)

    if ref_logprobs is not None and kl_coef > 0:
        # k3 estimator of KL(pi_theta || pi_ref): exp(ref - theta) - (ref - theta) - 1 >= 0.
        delta = ref_logprobs.detach() - logprobs
        kl = _aggregate(torch.exp(delta) - delta - 1.0, mask, n_tokens, weights)
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


def _sequence_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Each token's sequence's mean log-ratio over its (masked-in) tokens (GSPO), [B, T]."""
    flat_ids = ids.reshape(-1)
    n = int(flat_ids.max().item()) + 1 if flat_ids.numel() else 0
    sums = log_ratio.new_zeros(n).index_add(0, flat_ids, (log_ratio * mask).reshape(-1))
    counts = mask.new_zeros(n).index_add(0, flat_ids, mask.reshape(-1))
    return (sums / counts.clamp(min=1.0))[ids]


def _token_weights(opts: LossOptions, seqs: Sequences | None) -> torch.Tensor | None:
    """Each token's weight in the loss; None: the token mean (over ``num_tokens``)."""
    if opts.aggregation == "token_mean" or seqs is None:
        return None
    count = torch.as_tensor(seqs.count, dtype=torch.float32).clamp(min=1.0)
    if opts.aggregation == "seq_mean":
        return 1.0 / (seqs.lengths.float().clamp(min=1.0) * count)
    return torch.ones_like(seqs.lengths, dtype=torch.float32) / (count * opts.agg_tokens)


def _aggregate(
    terms: torch.Tensor, mask: torch.Tensor, n_tokens: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """The masked token terms as one number: their mean over ``n_tokens``, or weighted."""
    if weights is None:
        return (terms * mask).sum() / n_tokens
    return (terms * mask * weights).sum()


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

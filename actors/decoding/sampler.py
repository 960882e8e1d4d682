"""Speculative-sampling verification: one pure, batched rejection sampler. The rule and why it is
exact: docs/design.md §2.2; its use for delayed verification: §3.

Terms:

- ``K``: the padded number of draft positions in a batch; ``V``: the vocabulary size.
- **target** ``p_i`` (``i = 0..K``): the *processed* distribution (after temperature / top-p) of
  the verifying model at verify position ``i``. Position ``i`` scores the token that follows
  ``i`` accepted tokens, so ``p_{i-1}`` scores draft ``d_i`` and ``p_n`` is the bonus position.
- **draft** ``d_1..d_K`` and ``q_0..q_{K-1}``: the proposed tokens and the processed
  distributions they were sampled from (``d_{i+1} ~ q_i``). Deterministic proposers (n-gram
  lookup, greedy early exit) have a one-hot ``q`` at the draft token; pass ``draft_logprobs=None``.
  In delayed verification the draft is the stale policy ``π_old`` and the target ``π_new``.
- ``num_drafts`` ``n_b``: how many of row ``b``'s ``K`` draft positions are real; the rest are
  padding and are never read (their token ids may be ``-1``).
- **acceptance probability** ``a_i = min(1, p_{i-1}(d_i) / q_{i-1}(d_i))``; **accepted**
  ``m_b``: the longest accepted draft prefix; **residual** ``norm(max(0, p - q))``, sampled at
  the first rejection; **bonus**: the token sampled from ``p_{n_b}`` when all drafts are
  accepted; **emitted**: the accepted drafts, then the residual or bonus token.

Edge-case conventions:

- ``p(d) = 0`` (``-inf`` target log-prob): ``a = 0``, the draft is always rejected, and the
  residual gives ``d`` no mass. This wins over the next rule (``p(d) = q(d) = 0`` rejects).
- ``q(d) = 0 < p(d)``: ``a = 1`` (the limit of ``min(1, p/q)``). A correct proposer never
  samples a token its own ``q`` gives no mass, so this only happens when the draft came from
  elsewhere (e.g. a behaviour log-prob recorded under a different processing); the output is
  then exact only if such drafts are absent.
- Residual mass exactly 0: in exact arithmetic a rejection implies ``p != q`` and positive mass,
  but rounding can produce a rejection with ``max(0, p - q)`` summing to 0. Then the target
  ``p`` itself is sampled, which is the distribution being approximated.
- ``K = 0`` or ``n_b = 0``: plain sampling from ``p_0`` (``bonus=False`` then emits nothing).
- Every target row that can be sampled (position ``m_b`` of row ``b``) must have at least one
  finite entry; a row without any mass yields token 0 with log-prob ``-inf`` rather than an
  error, because checking would cost a device synchronisation per verification step.

Random-number consumption (the whole function is deterministic given ``generator``): exactly
one ``torch.rand((B, K + 1), dtype=float64)`` draw on the target's device, whatever
``num_drafts`` and ``bonus`` are. Column ``i < K`` decides draft ``d_{i+1}`` (accept iff
``u < a``); column ``K`` picks the extra token by inverse-CDF sampling of the final
distribution (residual or bonus). Columns of padded or unreached positions are drawn and unused.

Precision: acceptance ratios are computed from log-probs in float64 (``exp(log p - log q)``),
and the one ``[B, V]`` distribution per row that is sampled is formed in float64. No
``[B, K+1, V]`` float64 tensor is materialised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Marks token slots after a row's last emitted token.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class SpecResult:
    """Outcome of verifying one batch of drafts; row ``b`` emits ``tokens[b, :num_emitted[b]]``."""

    accepted: torch.Tensor  # [B] int64, accepted drafts m_b, 0..num_drafts[b]
    tokens: torch.Tensor  # [B, K+1] int64, accepted drafts then the extra token, then -1
    logprobs: torch.Tensor  # [B, K+1] float32, target log p of each emitted token, 0 after the end
    # [B] int64, accepted + 1 (accepted when bonus=False and none rejected)
    num_emitted: torch.Tensor


def acceptance_probs(
    target_logprobs_of_draft: torch.Tensor,  # [...] log p(d)
    draft_logprobs_of_draft: torch.Tensor,  # [...] log q(d)
) -> torch.Tensor:  # [...] float64 in [0, 1]
    """``min(1, p(d) / q(d))`` from log-probs, in float64, with the module's edge conventions.

    ``p(d) = 0`` gives 0 (also when ``q(d) = 0``); ``q(d) = 0 < p(d)`` gives 1.
    """
    log_p = target_logprobs_of_draft.to(torch.float64)
    log_q = draft_logprobs_of_draft.to(torch.float64)
    neg_inf = torch.full_like(log_p, -torch.inf)
    # Guard both infinite cases before subtracting: -inf - (-inf) would be NaN.
    log_ratio = torch.where(
        log_p == -torch.inf,
        neg_inf,
        torch.where(log_q == -torch.inf, torch.zeros_like(log_p), log_p - log_q),
    )
    return log_ratio.clamp(max=0.0).exp()


def residual_distribution(
    target_probs: torch.Tensor,  # [..., V] p, non-negative
    draft_probs: torch.Tensor,  # [..., V] q, non-negative (all zeros = sample p itself)
) -> torch.Tensor:  # [..., V] float64, sums to 1 (or all zeros when p has no mass)
    """``norm(max(0, p - q))``; falls back to ``norm(p)`` where the residual has no mass.

    A zero ``q`` row yields ``norm(p)``, which is how the bonus position shares this code path.
    """
    p = target_probs.to(torch.float64)
    residual = (p - draft_probs.to(torch.float64)).clamp(min=0.0)
    residual_mass = residual.sum(dim=-1, keepdim=True)  # [..., 1]
    residual = torch.where(residual_mass > 0, residual, p)
    total = residual.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)
    return residual / total


def sample_inverse_cdf(
    probs: torch.Tensor,  # [B, V] non-negative, need not be normalised
    uniforms: torch.Tensor,  # [B] in [0, 1)
) -> torch.Tensor:  # [B] int64
    """The token whose CDF interval contains ``u * total``; zero-mass tokens are never returned.

    Uses one uniform per row, so the random stream does not depend on ``V``.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    x = uniforms.to(torch.float64).unsqueeze(-1) * total  # [B, 1]
    # right=True: the first index with cdf > x; a zero-mass token repeats its predecessor's cdf
    # value, so it can never be the first to exceed x.
    index = torch.searchsorted(cdf.contiguous(), x.contiguous(), right=True).squeeze(-1)
    # Rounding can make u * total == total (index V); cap at the last token with mass, which is
    # the first index whose cdf reaches the total (cumsum of non-negatives is monotone).
    last_with_mass = (cdf < total).sum(dim=-1)
    return torch.minimum(index, last_with_mass)


def _check_shapes(
    target_logprobs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_logprobs: torch.Tensor | None,
    num_drafts: torch.Tensor | None,
) -> None:
    """Refuse inputs whose shapes or dtypes do not fit together (see ``rejection_sample``)."""
    if target_logprobs.dim() != 3:
        raise ValueError(f"target_logprobs must be [B, K+1, V], got {tuple(target_logprobs.shape)}")
    batch, positions, vocab = target_logprobs.shape
    k = positions - 1
    if draft_tokens.shape != (batch, k):
        raise ValueError(
            f"draft_tokens must be [B, K] = {(batch, k)} for target_logprobs "
            f"{tuple(target_logprobs.shape)}, got {tuple(draft_tokens.shape)}"
        )
    if draft_tokens.dtype.is_floating_point or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    if draft_logprobs is not None and draft_logprobs.shape != (batch, k, vocab):
        raise ValueError(
            f"draft_logprobs must be [B, K, V] = {(batch, k, vocab)}, "
            f"got {tuple(draft_logprobs.shape)}"
        )
    if num_drafts is not None and num_drafts.shape != (batch,):
        raise ValueError(f"num_drafts must be [B] = {(batch,)}, got {tuple(num_drafts.shape)}")


def rejection_sample(
    target_logprobs: torch.Tensor,  # [B, K+1, V] processed log p at verify positions 0..K
    draft_tokens: torch.Tensor,  # [B, K] int64, d_{i+1} is scored by target position i
    draft_logprobs: torch.Tensor | None,  # [B, K, V] processed log q; None = one-hot q at d
    num_drafts: torch.Tensor | None = None,  # [B] int64 in [0, K]; None = K for every row
    generator: torch.Generator | None = None,
    bonus: bool = True,
) -> SpecResult:
    """Verify drafts against the target with the speculative-sampling rule (see module terms);
    ``bonus=False`` skips the bonus token (finish-time verification does not decode on).

    ``num_drafts`` outside ``[0, K]`` breaks the caller's contract; it is clamped (not checked,
    which would cost a device synchronisation) so that it can never index out of bounds.
    """
    _check_shapes(target_logprobs, draft_tokens, draft_logprobs, num_drafts)
    batch, positions, vocab = target_logprobs.shape
    k = positions - 1
    device = target_logprobs.device
    rows = torch.arange(batch, device=device)  # [B]
    slots = torch.arange(k + 1, device=device)  # [K+1]
    if num_drafts is None:
        n = torch.full((batch,), k, dtype=torch.int64, device=device)
    else:
        n = num_drafts.to(device=device, dtype=torch.int64).clamp(0, k)  # [B]

    # The only random draw (see the module docstring for the column meanings).
    uniforms = torch.rand(
        (batch, k + 1), generator=generator, dtype=torch.float64, device=device
    )  # [B, K+1]

    # Accept step: the leading run of accepted valid drafts, fully vectorised.
    valid = slots[:k].unsqueeze(0) < n.unsqueeze(1)  # [B, K]
    drafts = torch.where(valid, draft_tokens.to(torch.int64), 0)  # [B, K], padding -> 0 for gather
    log_p_draft = target_logprobs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, K]
    if draft_logprobs is None:
        log_q_draft = torch.zeros_like(log_p_draft)  # one-hot q: q(d) = 1
    else:
        log_q_draft = draft_logprobs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, K]
    accept = (uniforms[:, :k] < acceptance_probs(log_p_draft, log_q_draft)) & valid  # [B, K]
    accepted = accept.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B]
    rejected = accepted < n  # [B]

    # Extra-token step: one [B, V] distribution per row, at target position m_b.
    p_final = target_logprobs[rows, accepted].to(torch.float64).exp()  # [B, V]
    if k == 0:
        q_final = torch.zeros_like(p_final)
    else:
        draft_pos = accepted.clamp(max=k - 1)  # a bonus row reads a dummy slot, zeroed below
        if draft_logprobs is None:
            q_final = torch.nn.functional.one_hot(drafts[rows, draft_pos], vocab).to(torch.float64)
        else:
            q_final = draft_logprobs[rows, draft_pos].to(torch.float64).exp()  # [B, V]
        q_final = q_final * rejected.unsqueeze(-1)  # bonus rows: q = 0, i.e. sample p itself
    extra = sample_inverse_cdf(residual_distribution(p_final, q_final), uniforms[:, k])  # [B]

    # Assemble: accepted drafts, then the extra token where one is emitted, then placeholders.
    emits_extra = rejected | bonus  # [B]
    drafts_padded = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)  # [B, K+1]
    tokens = torch.where(
        slots.unsqueeze(0) < accepted.unsqueeze(1), drafts_padded, PLACEHOLDER_TOKEN_ID
    )
    is_extra_slot = (slots.unsqueeze(0) == accepted.unsqueeze(1)) & emits_extra.unsqueeze(1)
    tokens = torch.where(is_extra_slot, extra.unsqueeze(1), tokens)  # [B, K+1]
    num_emitted = accepted + emits_extra.to(torch.int64)  # [B]

    emitted = tokens != PLACEHOLDER_TOKEN_ID  # [B, K+1]
    gathered = target_logprobs.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logprobs = torch.where(emitted, gathered.to(torch.float32), 0.0)  # [B, K+1]
    return SpecResult(accepted=accepted, tokens=tokens, logprobs=logprobs, num_emitted=num_emitted)


def pad_rows(
    rows: Sequence[Sequence[int]], width: int, fill: int, device: torch.device
) -> torch.Tensor:
    """``rows`` as one [len(rows), width] int64 tensor, each row right-padded with ``fill``."""
    out = torch.full((len(rows), width), fill, dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out

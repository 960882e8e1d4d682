"""The trained self-draft's loss (docs/design.md §2.1).

At each completion position: KL(p || q), where p is the policy's sampling distribution (at the
sampling temperature, restricted to the adapter's vocabulary and renormalised) and q the
adapter's, and sum_v min(p, q), the per-token acceptance of speculative sampling that this draft
would get (against the unrestricted p). Only the adapter's parameters receive a gradient: the
residual stream it reads, the policy's distribution and the frozen LM head all enter detached,
so the policy's own update is the same with or without the adapter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from common.model import Transformer
from common.sampling import processed_logprobs
from learner.microbatch import kl_and_acceptance


def loss_temperature(temperature: float) -> float:
    """The temperature the draft is trained at: the sampling one; greedy runs train at 1 (a
    one-hot target has no gradient to offer beyond its argmax)."""
    return temperature if temperature > 0 else 1.0


def draft_states(policy: Transformer, h_exit: Tensor) -> Tensor:
    """The adapter's normed output [B, S, H] over whole rows (causal, no cache) from the residual
    stream after ``draft_exit_layer`` layers, h_exit [B, S, H], taken detached."""
    return policy.draft_hidden(h_exit.detach(), None, None)


def _logprobs(
    policy: Transformer, h_full: Tensor, d: Tensor, temperature: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(log p over the whole vocabulary, log p restricted and renormalised, log q), [C, ·]."""
    with torch.no_grad():
        p_all = processed_logprobs(policy.lm_head(h_full.detach()).float(), temperature)
        ids = policy.draft.vocab_ids
        p = p_all if ids is None else p_all[:, ids]
        p = p - p.logsumexp(-1, keepdim=True)
    weight = policy.draft.head_weight(policy.lm_head.weight)  # [V_draft, H], detached
    q = processed_logprobs(F.linear(d, weight).float(), temperature)
    return p_all, p, q


def _terms(
    policy: Transformer, h_full: Tensor, d: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """(sum of KL(p || q), sum of sum_v min(p, q)) over one chunk of positions."""
    p_all, p, q = _logprobs(policy, h_full, d, temperature)
    ids = policy.draft.vocab_ids
    with torch.no_grad():
        p_draft = p_all if ids is None else p_all[:, ids]
        accept = torch.minimum(p_draft.exp(), q.detach().exp()).sum()
    return (p.exp() * (p - q)).sum(), accept


def _summed_terms(
    policy: Transformer, h_full: Tensor, d: Tensor, temperature: float, chunk: int
) -> tuple[Tensor, Tensor]:
    """``_terms`` over every position, ``chunk`` positions' logits at a time (recomputed in
    backward when the adapter's states need a gradient)."""
    return kl_and_acceptance(
        _terms, h_full.shape[0], chunk, d, lambda s: (policy, h_full[s], d[s], temperature)
    )


def adapter_terms(
    policy: Transformer, h_full: Tensor, d: Tensor, temperature: float, chunk: int
) -> tuple[Tensor, Tensor]:
    """``adapter_kl_sum`` and ``acceptance_sum`` (at the loss temperature) in one pass over the
    logits, for the learner's step, which reports both."""
    return _summed_terms(policy, h_full, d, loss_temperature(temperature), chunk)


def adapter_kl_sum(
    policy: Transformer,
    h_full: Tensor,  # [N, H] the policy's final-normed hidden states at completion positions
    d: Tensor,  # [N, H] the adapter's normed output at the same positions (draft_states)
    temperature: float,
    chunk: int,
) -> Tensor:
    """Sum over the N positions of KL(p || q) (see the module docstring), ``chunk`` positions'
    [chunk, V] logits at a time, recomputed in backward instead of kept."""
    return adapter_terms(policy, h_full, d, temperature, chunk)[0]


@torch.no_grad()
def acceptance_sum(
    policy: Transformer, h_full: Tensor, d: Tensor, temperature: float, chunk: int
) -> Tensor:
    """Sum over the N positions of sum_v min(p, q): the expected acceptance of one drafted token
    at each position, p the policy's full distribution and q the adapter's (zero outside its
    vocabulary), at the sampling temperature itself."""
    return _summed_terms(policy, h_full, d, temperature, chunk)[1]

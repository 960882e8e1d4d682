"""The EAGLE-3 head's loss (common/eagle.py; docs/training.md "The EAGLE-3 head").

The head at position t reads fc(aux_t), the policy's residual stream after each of
``eagle_aux_layers`` layers at t, and the embedding of token t+1, and drafts token t+2: it is
trained toward the policy's distribution at t+1 (as NeMo RL trains its head), at each position
t+1 that predicts a completion token. The loss is KL(p || q) at the loss temperature (the
sampling one; 1 for greedy runs), p restricted to the head's vocabulary and renormalised, q the
head's; the acceptance reported is sum_v min(p, q) against the unrestricted p (q is zero outside
its vocabulary), the per-token acceptance of speculative sampling with this draft.

With ``steps=2`` (``spec.eagle_steps``) a second, unrolled draft step is trained too (EAGLE-3's
training-time test): the head at t+1 reads its own first-step output at t in place of the
auxiliary states, and the embedding of token t+2, attends to the first step's keys at
positions <= t and to its own, and is trained toward the policy's distribution at t+2: what the
second draft token of a chain sees at decoding time, teacher-forced on the sampled tokens.

Only the head's parameters receive a gradient: the auxiliary states, the token embeddings and
the policy's distribution all enter detached, so the policy's own update is the same with or
without the head. The [N, V] logits exist ``chunk`` positions at a time and are recomputed in
backward (``learner.microbatch.over_chunks``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.model import Transformer
from common.sampling import processed_logprobs
from learner.draft_loss import loss_temperature
from learner.microbatch import kl_and_acceptance


def eagle_states(policy: Transformer, input_ids: Tensor, aux: list[Tensor]) -> Tensor:
    """The head's output before its final norm [B, S-1, H] at positions 0 .. S-2 over whole rows
    (causal, no cache): position t reads ``eagle.combine`` of the auxiliary states at t ([B, S,
    H] each, from ``run_layers(..., aux=)``) and the embedding of ``input_ids`` at t+1. What
    ``Transformer.run_eagle`` computes, with the embeddings detached from the policy."""
    head = policy.eagle
    if head is None:
        raise ValueError("this policy has no EAGLE-3 head (spec.method=eagle3 attaches one)")
    hidden = head.combine([a[:, :-1].detach() for a in aux])  # [B, S-1, H]
    with torch.no_grad():
        embeds = policy.model.embed_tokens(input_ids[:, 1:])
    _, mask, cos, sin = policy._attention_inputs(hidden, None, None)
    return head.midlayer(embeds, hidden, cos, sin, mask, None)


def unrolled_states(
    policy: Transformer, input_ids: Tensor, aux: list[Tensor], first: Tensor
) -> Tensor:
    """The head's second draft step [B, S-2, H]: entry t (at position t+1) reads ``first``'s
    output at t (``eagle_states``, [B, S-1, H]) and the embedding of ``input_ids`` at t+2, and
    attends to the first step's keys at positions 0 .. t and to its own key, as the second step
    of a draft chain does at decoding time over the head's KV cache. One causal pass over the
    first step's inputs followed by the second step's, under that mask."""
    head = policy.eagle
    B, S1, _ = first.shape
    T = S1 - 1
    hidden = torch.cat([head.combine([a[:, :-1].detach() for a in aux]), first[:, :-1]], dim=1)
    with torch.no_grad():
        embeds = policy.model.embed_tokens(torch.cat([input_ids[:, 1:], input_ids[:, 2:]], 1))
    dev = first.device
    positions = torch.cat([torch.arange(S1, device=dev), torch.arange(1, T + 1, device=dev)])
    _, _, cos, sin = policy._attention_inputs(hidden, positions.expand(B, -1), None)
    mask = torch.zeros((S1 + T, S1 + T), dtype=torch.bool, device=dev)
    mask[:S1, :S1] = torch.ones((S1, S1), dtype=torch.bool, device=dev).tril()
    mask[S1:, :S1] = torch.ones((T, S1), dtype=torch.bool, device=dev).tril()  # keys j <= t
    mask[S1:, S1:] = torch.eye(T, dtype=torch.bool, device=dev)
    out = head.midlayer(embeds, hidden, cos, sin, mask.expand(B, 1, -1, -1), None)
    return out[:, S1:]


def _terms(
    policy: Transformer, h_next: Tensor, prenorm: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """(sum of KL(p || q), sum of sum_v min(p, q)) over one chunk: h_next [C, H] the policy's
    final-normed states at t+1, prenorm [C, H] the head's output at t."""
    head = policy.eagle
    with torch.no_grad():
        p_all = processed_logprobs(policy.lm_head(h_next.detach()).float(), temperature)
        ids = head.vocab_ids
        p_draft = p_all if ids.numel() == p_all.shape[-1] else p_all[:, ids]
        p = p_draft - p_draft.logsumexp(-1, keepdim=True)
    q = processed_logprobs(head.logits(prenorm), temperature)
    with torch.no_grad():
        accept = torch.minimum(p_draft.exp(), q.exp()).sum()
    return (p.exp() * (p - q)).sum(), accept


def head_inputs(
    policy: Transformer,
    input_ids: Tensor,
    aux: list[Tensor],
    h: Tensor,
    sel: Tensor,
    steps: int = 1,
) -> list[tuple[Tensor, Tensor]]:
    """Per draft step k (1 .. ``steps``): (h_next [N_k, H], prenorm [N_k, H]) at the head
    positions t whose position t+k is a completion position (``sel`` [B, S-1], the step's mask
    over positions 0 .. S-2): the policy's final-normed state at t+k (of h [B, S, H], detached)
    and the head's k-th step output for t+k."""
    first = eagle_states(policy, input_ids, aux)  # [B, S-1, H]
    head_sel = sel[:, 1:]  # [B, S-2]: head position t <- the policy's position t+1
    out = [(h[:, 1:-1][head_sel].detach(), first[:, :-1][head_sel])]
    if steps >= 2:
        second = unrolled_states(policy, input_ids, aux, first)  # [B, S-2, H]
        sel2 = sel[:, 2:]  # [B, S-3]: entry t <- the policy's position t+2
        out.append((h[:, 2:-1][sel2].detach(), second[:, :-1][sel2]))
    return out


def eagle_kl_terms(
    policy: Transformer, h_next: Tensor, prenorm: Tensor, temperature: float, chunk: int
) -> tuple[Tensor, Tensor]:
    """(sum over the N positions of KL(p || q), sum of sum_v min(p, q)), both at
    ``loss_temperature(temperature)``, ``chunk`` positions' logits at a time (recomputed in
    backward when the head's output needs a gradient)."""
    t = loss_temperature(temperature)
    return kl_and_acceptance(
        _terms, h_next.shape[0], chunk, prenorm, lambda s: (policy, h_next[s], prenorm[s], t)
    )


def eagle_terms(
    policy: Transformer,
    input_ids: Tensor,  # [B, S]
    aux: list[Tensor],  # the auxiliary states, [B, S, H] each
    h: Tensor,  # [B, S, H] the policy's final-normed hidden states
    sel: Tensor,  # [B, S-1] bool: positions that predict a completion token
    temperature: float,
    chunk: int,
    steps: int = 1,
) -> tuple[Tensor, Tensor, int]:
    """(sum of KL(p || q) over the draft steps and positions, sum of the first step's
    acceptance, number of first-step positions) of one micro-batch (the module docstring), for
    the learner's step."""
    parts = head_inputs(policy, input_ids, aux, h, sel, steps)
    kl, accept = eagle_kl_terms(policy, *parts[0], temperature, chunk)
    for h_next, prenorm in parts[1:]:
        kl = kl + eagle_kl_terms(policy, h_next, prenorm, temperature, chunk)[0]
    return kl, accept, int(parts[0][0].shape[0])

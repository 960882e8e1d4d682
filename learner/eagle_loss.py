"""The EAGLE-3 head's loss (common/eagle.py; docs/training.md "The EAGLE-3 head").

The head at position t reads fc(aux_t), the policy's residual stream after each of
``eagle_aux_layers`` layers at t, and the embedding of token t+1, and drafts token t+2: it is
trained toward the policy's distribution at t+1 (as NeMo RL trains its head), at each position
t+1 that predicts a completion token. The loss is KL(p || q) at the loss temperature (the
sampling one; 1 for greedy runs), p restricted to the head's vocabulary and renormalised, q the
head's; the acceptance reported is sum_v min(p, q) against the unrestricted p (q is zero outside
its vocabulary), the per-token acceptance of speculative sampling with this draft.

With ``steps`` = K > 1 (``spec.eagle_steps``, default ``spec.k``) the later draft steps are
trained too (EAGLE-3's training-time test, :func:`ttt_states`): step j at entry t reads step j-1's
own output at t and the embedding of token t+j, attends to the first step's keys at positions
<= t and to the keys of steps 2..j of the same entry, and is trained toward the policy's
distribution at t+j: what the j-th draft token of a chain sees at decoding time, teacher-forced
on the sampled tokens. Each step is one pass of the head's layer (the earlier steps' keys and
values are reused), so the cost grows linearly in K; step j's KL is weighted
``spec.eagle_step_decay ** (j - 1)``.

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


class _Blocks:
    """The keys and values of the draft steps run so far: the ``kv`` cache of
    ``Attention.forward``, each step's block appended after the earlier ones'."""

    def __init__(self) -> None:
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []

    def update(self, layer: int, k: Tensor, v: Tensor, positions: Tensor, width: int):
        self.k.append(k)
        self.v.append(v)
        return torch.cat(self.k, 2), torch.cat(self.v, 2)


def ttt_mask(sizes: list[int], T: int, device: torch.device) -> Tensor:
    """[T, sum(sizes) + T] bool: what entry t of the next step (after steps of ``sizes`` entries)
    attends to: the first step's keys <= t (causal over the first step's own block), and the key
    of entry t in each later step's block and its own."""
    mask = torch.zeros((T, sum(sizes) + T), dtype=torch.bool, device=device)
    if not sizes:
        mask[:, :T] = torch.ones((T, T), dtype=torch.bool, device=device).tril()
        return mask
    mask[:, : sizes[0]] = torch.ones((T, sizes[0]), dtype=torch.bool, device=device).tril()
    start = sizes[0]
    for size in [*sizes[1:], T]:
        mask[:, start : start + size] = torch.eye(T, size, dtype=torch.bool, device=device)
        start += size
    return mask


def ttt_states(
    policy: Transformer, input_ids: Tensor, aux: list[Tensor], steps: int
) -> list[Tensor]:
    """The head's outputs before its final norm for draft steps j = 1 .. ``steps``, [B, S-j, H]
    each (fewer when the rows are too short): entry t of step j sits at position t+j-1, reads
    step j-1's output at t (step 1: ``eagle.combine`` of the auxiliary states at t) and the
    embedding of ``input_ids`` at t+j, and attends to step 1's keys at positions <= t and to the
    keys of steps 2..j of entry t: the j-th step of a draft chain over the head's KV cache,
    teacher-forced. One pass of the head's layer per step, the earlier steps' keys and values
    reused (:class:`_Blocks`). Step 1 is :func:`eagle_states`."""
    head = policy.eagle
    if head is None:
        raise ValueError("this policy has no EAGLE-3 head (spec.method=eagle3 attaches one)")
    B, S = input_ids.shape
    dev = input_ids.device
    blocks, sizes, outs = _Blocks(), [], []
    hidden = head.combine([a[:, :-1].detach() for a in aux])  # [B, S-1, H]
    for j in range(1, steps + 1):
        T = S - j
        if T <= 0:
            break
        hidden = hidden[:, :T]
        with torch.no_grad():
            embeds = policy.model.embed_tokens(input_ids[:, j : j + T])
        positions = (torch.arange(T, device=dev) + j - 1).expand(B, -1)
        _, _, cos, sin = policy._attention_inputs(hidden, positions, None)
        mask = ttt_mask(sizes, T, dev).expand(B, 1, -1, -1)
        out = head.midlayer(embeds, hidden, cos, sin, mask, (blocks, 0, positions))
        sizes.append(T)
        outs.append(out)
        hidden = out
    return outs


def step_weights(steps: int, decay: float) -> list[float]:
    """Step j's weight in the head's loss: ``decay ** (j - 1)``."""
    return [decay ** (j - 1) for j in range(1, steps + 1)]


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
    logits = head.logits(prenorm)
    q = processed_logprobs(logits * head.sharpening, temperature)
    with torch.no_grad():
        # The acceptance of the q the engines draft from (the published, sharpened logits).
        q_pub = q if head.sharpening == 1.0 else processed_logprobs(logits, temperature)
        accept = torch.minimum(p_draft.exp(), q_pub.exp()).sum()
    return (p.exp() * (p - q)).sum(), accept


def head_inputs(
    policy: Transformer,
    input_ids: Tensor,
    aux: list[Tensor],
    h: Tensor,
    sel: Tensor,
    steps: int = 1,
) -> list[tuple[Tensor, Tensor]]:
    """Per draft step j (1 .. ``steps``): (h_next [N_j, H], prenorm [N_j, H]) at the head
    entries t whose policy position t+j is a completion position (``sel`` [B, S-1], the step's
    mask over positions 0 .. S-2): the policy's final-normed state at t+j (of h [B, S, H],
    detached) and the head's j-th step output for it (:func:`ttt_states`). Steps the rows are
    too short for are empty."""
    outs = ttt_states(policy, input_ids, aux, steps)
    H = h.shape[-1]
    parts = []
    for j in range(1, steps + 1):
        width = input_ids.shape[1] - 1 - j  # entries t = 0 .. S-2-j
        if j > len(outs) or width <= 0:
            empty = h.new_zeros((0, H))
            parts.append((empty, empty))
            continue
        sel_j = sel[:, j:]
        parts.append((h[:, j:-1][sel_j].detach(), outs[j - 1][:, :width][sel_j]))
    return parts


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
    decay: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(sum over the draft steps j of ``decay ** (j-1)`` times the sum of KL(p || q) over the
    step's positions; per step, the sum of the acceptance [steps]; per step, its number of
    positions [steps]) of one micro-batch (the module docstring), for the learner's step."""
    parts = head_inputs(policy, input_ids, aux, h, sel, steps)
    kl = h.new_zeros((), dtype=torch.float32)
    accepts, counts = [], []
    for weight, (h_next, prenorm) in zip(step_weights(steps, decay), parts, strict=True):
        if h_next.shape[0] == 0:
            accepts.append(kl.new_zeros(()))
            counts.append(0.0)
            continue
        part, accept = eagle_kl_terms(policy, h_next, prenorm, temperature, chunk)
        kl = kl + weight * part
        accepts.append(accept.float())
        counts.append(float(h_next.shape[0]))
    return kl, torch.stack(accepts), torch.tensor(counts, device=kl.device)

"""Memory-bounded pieces of a training step: token-budget micro-batches, rank shards, and
log-probs of the chosen tokens computed in chunks at completion positions only.

Why: the straightforward step materialises fp32 logits [B, S, V] at every position (prompt
included) and a full ``log_softmax`` of them, and keeps both for backward. At a 150k vocabulary
that is ~0.6 MB per position per copy. Here
- the LM head runs only at completion positions (the only ones the loss reads);
- it runs ``chunk`` positions at a time, each chunk under activation checkpointing: what stays
  alive for backward is the chunk's hidden states and one log-prob per position; the [chunk, V]
  logits are recomputed in backward (one extra LM-head matmul per chunk);
- rows are grouped into micro-batches of at most ``max_tokens`` padded tokens, each trimmed to
  its own longest row, and gradients accumulate across them.

Exactness: every loss term is a sum over completion tokens divided by the number of completion
tokens of the *global* batch (all micro-batches, all ranks), so the sum of the micro-batch
gradients is the gradient of the one-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from common.sampling import processed_logprobs
from learner.batch import TrainBatch


@dataclass
class MicroBatch:
    input_ids: Tensor  # [b, s] int64
    targets: Tensor  # [b, s-1]
    mask: Tensor  # [b, s-1] float32
    behaviour_logprobs: Tensor  # [b, s-1]
    advantages: Tensor  # [b]


def row_lengths(batch: TrainBatch) -> list[int]:
    """Real length (prompt + completion) of each row: the last completion target + 1, + 1 for
    the shift; a row without completion tokens keeps the batch width."""
    S = batch.input_ids.shape[1]
    idx = torch.arange(S - 1, device=batch.mask.device).expand_as(batch.mask)
    last = torch.where(batch.mask > 0, idx, torch.full_like(idx, -1)).amax(dim=1)
    return [int(v) + 2 if v >= 0 else S for v in last.tolist()]


def shard_rows(lengths: list[int], world: int, rank: int) -> list[int]:
    """This rank's rows: longest first, each to the rank with the fewest tokens so far (ties to
    the lowest rank). Deterministic, so every rank computes the same partition."""
    load = [0] * world
    owner = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += lengths[i]
    return [i for i in range(len(lengths)) if owner[i] == rank]


def plan_microbatches(rows: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Rows grouped into micro-batches of at most ``max_tokens`` padded tokens (rows x longest
    row; a row longer than the budget goes alone). ``max_tokens <= 0``: one micro-batch."""
    if not rows:
        return []
    if max_tokens <= 0:
        return [list(rows)]
    out: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in sorted(rows, key=lambda i: (-lengths[i], i)):
        w = max(width, lengths[i])
        if current and w * (len(current) + 1) > max_tokens:
            out.append(current)
            current, w = [], lengths[i]
        current.append(i)
        width = w
    out.append(current)
    return out


def take_rows(batch: TrainBatch, rows: list[int], lengths: list[int]) -> MicroBatch:
    s = max(lengths[i] for i in rows)
    idx = torch.tensor(rows, dtype=torch.long, device=batch.input_ids.device)
    return MicroBatch(
        input_ids=batch.input_ids[idx, :s],
        targets=batch.targets[idx, : s - 1],
        mask=batch.mask[idx, : s - 1],
        behaviour_logprobs=batch.behaviour_logprobs[idx, : s - 1],
        advantages=batch.advantages[idx],
    )


def empty_microbatch(batch: TrainBatch) -> MicroBatch:
    """A one-row micro-batch with no completion token: contributes nothing to the loss, but
    keeps a rank with fewer rows in step with the others' FSDP collectives."""
    return MicroBatch(
        input_ids=batch.input_ids[:1, :2],
        targets=batch.targets[:1, :1],
        mask=torch.zeros_like(batch.mask[:1, :1]),
        behaviour_logprobs=batch.behaviour_logprobs[:1, :1],
        advantages=batch.advantages[:1],
    )


def _head_logprobs(
    lm_head: nn.Module, h: Tensor, targets: Tensor, temperature: float, top_p: float
) -> Tensor:
    logits = lm_head(h).float()  # [C, V]
    lp = processed_logprobs(logits, temperature, top_p)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [C]


def over_chunks(
    fn: Callable[..., Any], n: int, chunk: int, recompute: bool, args: Callable[[slice], tuple]
) -> list[Any]:
    """``fn(*args(s))`` for each slice ``s`` of ``chunk`` positions out of ``n`` (all of them
    at once when ``chunk`` <= 0), so only one chunk's [chunk, V] logits exist at a time; with
    ``recompute`` each call is checkpointed: recomputed in backward instead of kept."""
    step = chunk if chunk > 0 else max(n, 1)
    out = []
    for i in range(0, n, step):
        part = args(slice(i, i + step))
        out.append(checkpoint(fn, *part, use_reentrant=False) if recompute else fn(*part))
    return out


def kl_and_acceptance(
    terms: Callable[..., tuple[Tensor, Tensor]],
    n: int,
    chunk: int,
    draft: Tensor,
    args: Callable[[slice], tuple],
) -> tuple[Tensor, Tensor]:
    """(sum of the KL terms, sum of the acceptance terms), float32 scalars, of ``terms(*args(s))``
    (a draft's (KL, acceptance) over one chunk) over the ``chunk``-position slices of ``n``
    (``over_chunks``), recomputed in backward when ``draft`` (the draft's output [n, H]) needs a
    gradient."""
    recompute = torch.is_grad_enabled() and draft.requires_grad
    kl = draft.new_zeros((), dtype=torch.float32)
    accept = torch.zeros((), dtype=torch.float32, device=draft.device)
    for part, acc in over_chunks(terms, n, chunk, recompute, args):
        kl, accept = kl + part, accept + acc.float()
    return kl, accept


def chosen_logprobs(
    lm_head: nn.Module,
    h: Tensor,  # [N, H] final-normed hidden states at completion positions
    targets: Tensor,  # [N]
    temperature: float,
    top_p: float,
    chunk: int,
) -> Tensor:
    """Processed log-prob [N] of each target token; the [chunk, V] logits of one chunk at a
    time exist, and (with grad) are recomputed in backward instead of kept."""
    out = over_chunks(
        _head_logprobs,
        h.shape[0],
        chunk,
        torch.is_grad_enabled() and h.requires_grad,
        lambda s: (lm_head, h[s], targets[s], temperature, top_p),
    )
    return torch.cat(out) if out else h.new_zeros(0, dtype=torch.float32)


def _exit_kl_sum(lm_head: nn.Module, h: Tensor, h_exit: Tensor, temperature: float) -> Tensor:
    with torch.no_grad():
        p = processed_logprobs(lm_head(h).float(), temperature)  # the full model's side: detached
    q = processed_logprobs(lm_head(h_exit).float(), temperature)
    return (p.exp() * (p - q)).sum()


def exit_kl_sum(
    lm_head: nn.Module, h: Tensor, h_exit: Tensor, temperature: float, chunk: int
) -> Tensor:
    """Sum over positions of KL(p_full || q_exit) (``learner.loss.early_exit_kl`` before its
    division), chunked and recomputed in backward like ``chosen_logprobs``."""
    parts = over_chunks(
        _exit_kl_sum,
        h.shape[0],
        chunk,
        torch.is_grad_enabled() and h_exit.requires_grad,
        lambda s: (lm_head, h[s], h_exit[s], temperature),
    )
    return sum(parts, h_exit.new_zeros((), dtype=torch.float32))

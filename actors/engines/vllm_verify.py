"""Delayed verification from bounded records (docs/design.md §3.4), for engines that keep no old
weights: the old policy is known only through what was recorded while sampling, the sampled
token's processed log-prob and the processed top ``K`` (``K = -1``: everything, exact).
Acceptance is exact; the residual at the first rejection is estimated where the old probability
was not recorded, and :func:`verified_token_distribution` computes the resulting law exactly so
its distance to the new policy can be measured (``benchmarks/engines.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def record_of(entry: Mapping[int, Any]) -> tuple[np.ndarray, np.ndarray]:
    """A vLLM ``{token: Logprob}`` map as the bounded record (ids int32, log-probs fp32)."""
    ids = np.fromiter(entry.keys(), dtype=np.int32, count=len(entry))
    logprobs = np.fromiter((e.logprob for e in entry.values()), dtype=np.float32, count=len(entry))
    return ids, logprobs


def residual(
    p_ids: np.ndarray,
    p_logprobs: np.ndarray,
    q_ids: np.ndarray,
    q_logprobs: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """``norm(max(p - q, 0))`` over the tokens whose ``p`` is known (module docstring): (ids,
    probabilities). Exact when both records cover the whole support."""
    p = np.exp(p_logprobs.astype(np.float64))
    q_known = dict(zip(q_ids.tolist(), np.exp(q_logprobs.astype(np.float64)).tolist(), strict=True))
    q = np.array([q_known.get(t, math.nan) for t in p_ids.tolist()])
    unknown = np.isnan(q)
    if unknown.any():
        q_out = max(0.0, 1.0 - sum(q_known.values()))  # old mass outside its record
        p_out = max(1e-30, 1.0 - float(p[~unknown].sum()))  # new mass outside q's record
        cap = min(q_known.values()) if q_known else 1.0
        q[unknown] = np.minimum(p[unknown] * q_out / p_out, cap)
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    if not total > 0:  # nothing left where p is known: fall back on p there
        r, total = p, p.sum()
    return p_ids, r / total


def verify_row(
    tokens: list[int],
    old_logprobs: list[float],
    new_logprobs: list[float],
    new_records: list[tuple[np.ndarray, np.ndarray]],
    old_records: list[tuple[np.ndarray, np.ndarray]],
    generator: torch.Generator,
) -> tuple[int, int | None, float | None]:
    """The acceptance rule over one row's stale tokens: (accepted count, the residual token at
    the first rejection or None, its new log-prob)."""
    for i, token in enumerate(tokens):
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u < math.exp(min(0.0, new_logprobs[i] - old_logprobs[i])):
            continue
        ids, probs = residual(*new_records[i], *old_records[i])
        pick = int(torch.multinomial(torch.from_numpy(probs), 1, generator=generator))
        new_lp = dict(zip(new_records[i][0].tolist(), new_records[i][1].tolist(), strict=True))
        token = int(ids[pick])
        return i, token, float(new_lp[token])
    return len(tokens), None, None


def _top(logprobs: torch.Tensor, k: int, extra: int) -> tuple[np.ndarray, np.ndarray]:
    ids = torch.from_numpy(record_ids(logprobs, k, extra).astype(np.int64))
    ids = ids[torch.isfinite(logprobs[ids])]
    return ids.numpy().astype(np.int32), logprobs[ids].numpy().astype(np.float32)


def verified_token_distribution(new: torch.Tensor, old: torch.Tensor, k: int) -> torch.Tensor:
    """The exact distribution of the token verification leaves at one position when the stale
    token was drawn from ``old`` and both policies are recorded as top ``k`` + the stale token
    (``new``/``old``: [V] processed log-probs). Equals ``exp(new)`` when the residual is exact."""
    p, q = new.double().exp(), old.double().exp()
    out = torch.minimum(p, q).clone()
    for y in torch.nonzero(q > 1e-12).flatten().tolist():
        reject = float(q[y] - torch.minimum(p[y], q[y]))
        if reject <= 0:
            continue
        ids, probs = residual(*_top(new, k, y), *_top(old, k, y))
        out[torch.from_numpy(ids.astype(np.int64))] += reject * torch.from_numpy(probs)
    return out


def record_ids(logprobs: torch.Tensor, k: int, token: int) -> np.ndarray:
    """Ids of the top ``k`` (all for -1) finite entries of ``logprobs`` and ``token``."""
    if 0 < k < logprobs.numel():
        ids = torch.topk(logprobs, k).indices
    else:
        ids = torch.nonzero(torch.isfinite(logprobs)).flatten()
    ids = torch.unique(torch.cat([ids, torch.tensor([token])]))
    return ids.numpy().astype(np.int32)


def dense_logprobs(entries, vocab: int) -> torch.Tensor:
    """A vLLM ``{token: Logprob}`` map as a [V] log-prob vector (tokens it does not list: -inf)."""
    dense = torch.full((vocab,), float("-inf"))
    for token, entry in entries.items():
        dense[token] = entry.logprob
    return dense

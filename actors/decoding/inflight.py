"""Delayed verification (docs/design.md §3.2-3.3): in-flight tokens sampled under older weights
are a draft of the old policy for the new one, verified by one forward of the new weights over
``prompt + tokens`` (which also writes the new KV cache) and the rejection sampler of
:func:`actors.decoding.sampler.rejection_sample`. The residual needs the *full* old distribution, so
the engine keeps the old weights until verification is done and scores the rows with them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from actors.decoding.sampler import SpecResult, pad_rows, rejection_sample
from common.layers import KVCache
from common.model import Transformer
from common.sampling import processed_logprobs


@dataclass
class Verification:
    tokens: list[list[int]]  # per row: accepted prefix, then the residual/bonus token if any
    logprobs: list[list[float]]  # log pi_new of each kept token
    accepted: list[int]  # tokens of the old prefix kept, per row
    gaps: list[list[int]]  # per row: new_version - v_i for every verified token (for metrics)
    forward_tokens: int  # tokens pushed through verification forwards (its cost)

    @classmethod
    def of(
        cls, result: SpecResult, n: list[int], gaps: list[list[int]], forward_tokens: int
    ) -> Verification:
        """From the rejection sampler's ``result`` over rows of ``n[b]`` verified tokens whose
        version gaps start ``gaps[b]``."""
        emitted = result.num_emitted.tolist()
        accepted = result.accepted.tolist()
        tokens = result.tokens.tolist()
        logprobs = result.logprobs.tolist()
        rows = range(len(n))
        return cls(
            tokens=[tokens[b][: emitted[b]] for b in rows],
            logprobs=[logprobs[b][: emitted[b]] for b in rows],
            accepted=accepted,
            gaps=[gaps[b][: n[b]] for b in rows],
            forward_tokens=forward_tokens,
        )

    @classmethod
    def concat(cls, parts: Sequence[Verification]) -> Verification:
        """The verification of several row chunks, rows in chunk order."""
        return cls(
            tokens=[t for p in parts for t in p.tokens],
            logprobs=[lp for p in parts for lp in p.logprobs],
            accepted=[a for p in parts for a in p.accepted],
            gaps=[g for p in parts for g in p.gaps],
            forward_tokens=sum(p.forward_tokens for p in parts),
        )


@torch.no_grad()
def verify_rows(
    target: Transformer,
    target_version: int,
    old_models: Mapping[int, Transformer],
    prompts: Sequence[Sequence[int]],
    tokens: Sequence[Sequence[int]],
    versions: Sequence[Sequence[int]],
    temperature: float,
    top_p: float,
    cache: Any,
    generator: torch.Generator | None,
    bonus: bool,
    pad_id: int,
) -> Verification:
    """Verify every row's generated tokens against ``target`` (see the module docstring).

    ``old_models[v]`` must hold the weights of every version ``v < target_version`` that appears
    in ``versions``. ``cache``: where the new weights' k/v of the rows are written (the engine's
    block pool bound to these rows, so no second cache is allocated), or None for a fresh
    contiguous one in the target's dtype. ``bonus``: when a row keeps every token, also sample
    its next token from ``pi_new`` (swap-time verification continues decoding; finish-time
    verification does not).
    """
    device = next(target.parameters()).device
    batch = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # [B]
    n = [len(t) for t in tokens]
    longest = max(n)  # the most tokens any row holds in flight
    width = max(len(p) + len(t) for p, t in zip(prompts, tokens, strict=True))
    input_ids = pad_rows(
        [[*p, *t] for p, t in zip(prompts, tokens, strict=True)], width, pad_id, device
    )
    positions = torch.arange(width, device=device).expand(batch, -1)  # [B, W]
    rows = torch.arange(batch, device=device)[:, None]
    # Scores of y_1..y_n (and of the next token) sit at positions len-1 .. len-1+n.
    at = ((lengths - 1)[:, None] + torch.arange(longest + 1, device=device)).clamp(max=width - 1)

    if cache is None:
        dtype = next(target.parameters()).dtype
        cache = KVCache(target.args, batch, width, device=device, dtype=dtype)
    # The LM head runs only where scores are read ([B, K+1] positions, not all [B, W]): at a
    # real vocabulary the [B, W, V] logits would dwarf the model.
    target_lp = processed_logprobs(
        target.lm_head(target.hidden_states(input_ids, positions, cache)[rows, at]).float(),
        temperature,
        top_p,
    )
    forward_tokens = batch * width  # [B, K+1, V] above

    draft_tokens = pad_rows(tokens, longest, pad_id, device)
    version_of = pad_rows(versions, longest, target_version, device)
    draft_lp, old_forward_tokens = _draft_logprobs(
        target_lp[:, :longest],
        target_version,
        old_models,
        version_of,
        input_ids,
        at,
        temperature,
        top_p,
    )
    forward_tokens += old_forward_tokens

    num_drafts = torch.tensor(n, device=device)
    result = rejection_sample(
        target_lp, draft_tokens, draft_lp, num_drafts, generator=generator, bonus=bonus
    )
    gaps = (target_version - version_of).tolist()
    return Verification.of(result, n, gaps, forward_tokens)


def _draft_logprobs(
    target_lp: torch.Tensor,
    target_version: int,
    old_models: Mapping[int, Transformer],
    version_of: torch.Tensor,
    input_ids: torch.Tensor,
    at: torch.Tensor,
    temperature: float,
    top_p: float,
) -> tuple[torch.Tensor, int]:
    """The draft distributions ``q`` [B, K, V] of the verified tokens, from the weights of the
    version each was sampled with, and the tokens pushed through those old forwards.

    ``target_lp``: the new policy at the K verified positions (``q = p`` for tokens already of
    the target version: accepted with probability 1); ``version_of`` [B, K]: each token's
    version; ``at`` [B, K + 1]: the positions whose scores are read."""
    k = target_lp.shape[1]
    width = input_ids.shape[1]
    positions = torch.arange(width, device=input_ids.device).expand(input_ids.shape[0], -1)
    draft_lp = target_lp.clone()
    forward_tokens = 0
    for version in sorted(set(version_of.unique().tolist()) - {target_version}):
        if version not in old_models:
            raise KeyError(f"no weights kept for version {version}; cannot verify exactly")
        sel = (version_of == version).any(dim=1).nonzero().squeeze(-1)  # rows with such tokens
        # The old model scores only the selected rows: index its output by their rank.
        old = old_models[version]
        ranks = torch.arange(len(sel), device=input_ids.device)[:, None]
        hidden = old.hidden_states(input_ids[sel], positions[sel])[ranks, at[sel, :k]]
        old_lp = processed_logprobs(old.lm_head(hidden).float(), temperature, top_p)  # [B_v, K, V]
        forward_tokens += len(sel) * width
        here = (version_of[sel] == version).unsqueeze(-1)  # [B_v, K, 1]
        draft_lp[sel] = torch.where(here, old_lp, draft_lp[sel])
    return draft_lp, forward_tokens

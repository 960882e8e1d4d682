"""The EAGLE-3 drafter (docs/design.md §2.1): the policy's EAGLE-3 head (common/eagle.py), its
draft tokens and draft log q for the rejection sampler (:mod:`actors.decoding.sampler`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.layers import KVCache
from common.model import Transformer
from common.sampling import processed_logprobs, sample_tokens


@dataclass
class EagleDraft:
    tokens: torch.Tensor  # [B, K] int64 drafted target ids d_1..d_K
    logprobs: torch.Tensor  # [B, K, V] processed draft log q (-inf outside the head's vocabulary)


class EagleDrafter:
    """Drafts with the policy's EAGLE-3 head (common/eagle.py), vLLM's way: a first pass over a
    row's positions not yet through the head (the policy's auxiliary states at t with the token
    at t + 1, writing the head's KV at t), whose last output drafts d_1; then k - 1 one-token
    passes on the head's own output. q is the head's distribution at the sampling temperature
    and top-p over its vocabulary, mapped to target ids (no mass elsewhere), so the rejection
    sampler stays exact. ``version``: the weights version of ``model`` (the engine keeps both
    current; drafts come from the policy's own head)."""

    def __init__(self, model: Transformer, version: int) -> None:
        if getattr(model, "eagle", None) is None:
            raise ValueError(
                "spec.method=eagle3, but the policy has no EAGLE-3 head (eagle.* tensors; "
                "ModelArgs.eagle_aux_layers empty): warm-start one (specrl warm-draft "
                "spec.method=eagle3) or let the learner attach one"
            )
        self._vocab_ids: torch.Tensor | None = None  # target ids of the head's vocabulary
        self.use(model, version)

    def use(self, model: Transformer, version: int) -> None:
        """Draft with ``model``'s head from now on (a new version, loaded or adopted)."""
        self.model, self.version = model, version
        head = model.eagle
        if head is None:
            raise ValueError("the policy has no EAGLE-3 head")
        whole = head.d2t.numel() == model.args.vocab_size and not bool(head.d2t.any())
        self._vocab_ids = None if whole else head.vocab_ids

    def head_pass(
        self,
        aux: torch.Tensor,  # [B, T, n_aux * H] the policy's auxiliary states at positions
        next_ids: torch.Tensor,  # [B, T] the token after each of them
        positions: torch.Tensor,  # [B, T]
        cache: KVCache,
    ) -> torch.Tensor:
        """The head's first pass: its KV written at ``positions``; outputs [B, T, H]."""
        return self.model.run_eagle(next_ids, self.model.eagle.combine(aux), positions, cache)

    def _sample(
        self,
        hidden: torch.Tensor,  # [B, H] a head output
        temperature: float,
        top_p: float,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampled target ids [B], processed log q [B, V] over the whole vocabulary)."""
        head = self.model.eagle
        q_draft = processed_logprobs(head.logits(hidden), temperature, top_p)  # [B, V_draft]
        index, _ = sample_tokens(q_draft, generator)
        if self._vocab_ids is None:
            return index, q_draft
        q = q_draft.new_full((q_draft.shape[0], self.model.args.vocab_size), float("-inf"))
        q[:, self._vocab_ids] = q_draft  # no mass outside the draft vocabulary
        return self._vocab_ids[index], q

    def draft(
        self,
        first: torch.Tensor,  # [B, H] the first pass's output at the position before `last`
        positions: torch.Tensor,  # [B] position of the token not yet in the cache (`last`)
        cache: KVCache,
        k: int,
        temperature: float,
        top_p: float,
        generator: torch.Generator | None,
    ) -> EagleDraft:
        """``k`` drafts per row: d_1 from ``first``, then one head pass per further draft (the
        previous output with the previous draft, at the positions of ``last`` onwards)."""
        hidden = first[:, None]  # [B, 1, H]
        tokens, logprobs = [], []
        for i in range(k):
            if i > 0:
                pos = (positions + i - 1)[:, None]
                hidden = self.model.run_eagle(tokens[-1][:, None], hidden, pos, cache)
            token, q = self._sample(hidden[:, 0], temperature, top_p, generator)
            tokens.append(token)
            logprobs.append(q)
        return EagleDraft(tokens=torch.stack(tokens, dim=1), logprobs=torch.stack(logprobs, dim=1))

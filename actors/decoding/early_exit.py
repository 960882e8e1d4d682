"""The early-exit drafter (docs/design.md §2.1): the policy's first ``exit_layer`` layers, whose
KV slots are the full model's, so verification resumes at that layer. It returns what the
rejection sampler (:mod:`actors.decoding.sampler`) needs; the verify forward lives in the
engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.layers import KVCache
from common.model import Transformer
from common.sampling import processed_logprobs, sample_tokens


@dataclass
class EarlyExitDraft:
    tokens: torch.Tensor  # [B, K] int64 drafted tokens d_1..d_K
    logprobs: torch.Tensor  # [B, K, V] processed draft log q at positions 0..K-1
    hidden: torch.Tensor  # [B, K + 1, H] residual stream after layer E for last token, d_1..d_K


class EarlyExitDrafter:
    """Drafts with the first ``exit_layer`` layers of the policy itself, then either the final
    norm and LM head (``adapter=False``) or the policy's trained draft adapter (its own decoder
    layer and norm, the LM head over its reduced vocabulary; its exit is the model's
    ``draft_exit_layer``, whatever ``exit_layer`` says)."""

    def __init__(self, model: Transformer, exit_layer: int, adapter: bool = False) -> None:
        layers = model.args.num_hidden_layers
        if adapter:
            if model.draft is None:
                raise ValueError(
                    "spec.adapter=true, but the policy has no draft adapter: warm-start one "
                    "(specrl warm-draft ...) or let the learner attach one (it does with "
                    "spec.adapter=true)"
                )
            exit_layer = model.args.draft_exit_layer
        if not 1 <= exit_layer < layers:
            raise ValueError(
                f"spec.exit_layer={exit_layer} must be in [1, {layers - 1}] for a "
                f"{layers}-layer model (the draft must be cheaper than the model)"
            )
        self.model = model
        self.exit_layer = exit_layer
        self.adapter = adapter

    def _draft_logprobs(
        self,
        h: torch.Tensor,  # [B, 1, H] residual stream after the exit
        position: torch.Tensor,  # [B, 1]
        cache: KVCache,
        temperature: float,
        top_p: float,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampled tokens [B], processed log q [B, V] over the whole vocabulary)."""
        if not self.adapter:
            q = processed_logprobs(self.model.head(h)[:, 0], temperature, top_p)  # [B, V]
            return sample_tokens(q, generator)[0], q
        q_draft = processed_logprobs(
            self.model.run_draft(h, position, cache)[:, 0], temperature, top_p
        )  # [B, V_draft]
        index, _ = sample_tokens(q_draft, generator)
        ids = self.model.draft.vocab_ids
        if ids is None:
            return index, q_draft
        q = q_draft.new_full((q_draft.shape[0], self.model.args.vocab_size), float("-inf"))
        q[:, ids] = q_draft  # no mass outside the draft vocabulary
        return ids[index], q

    def draft(
        self,
        last_tokens: torch.Tensor,  # [B] tokens not yet in the cache
        positions: torch.Tensor,  # [B] position of last_tokens
        cache: KVCache,
        k: int,
        temperature: float,
        top_p: float,
        generator: torch.Generator | None,
        forced: Sequence[Sequence[int]] | None = None,
    ) -> EarlyExitDraft:
        """``k`` drafts per row from the early exit. ``forced`` (per row, up to ``k`` tokens) fixes
        a row's first drafts instead (e.g. an n-gram match); their q is one-hot, which keeps the
        rejection sampler exact, and the exit drafts on after them."""
        hidden, tokens, logprobs = [], [], []
        token = last_tokens
        fixed = None
        if forced is not None and any(forced):
            # [B, K] forced tokens and a mask of where they apply.
            fixed = torch.zeros((len(forced), k), dtype=torch.long, device=last_tokens.device)
            where = torch.zeros((len(forced), k), dtype=torch.bool, device=last_tokens.device)
            for row, draft in enumerate(forced):
                fixed[row, : len(draft)] = torch.tensor(draft[:k], dtype=torch.long)
                where[row, : len(draft)] = True
        for i in range(k + 1):
            # Layers [0, E) for one token per row; writes their cache slots at positions + i.
            x = self.model.model.embed_tokens(token[:, None])  # [B, 1, H]
            h = self.model.run_layers(x, (positions + i)[:, None], cache, 0, self.exit_layer)
            hidden.append(h)
            if i == k:
                # The last draft only needs its early layers (for verification) and the
                # adapter's KV (for the next step's drafts, should it be accepted).
                if self.adapter:
                    self.model.run_draft(h, (positions + i)[:, None], cache, head=False)
                break
            token, q = self._draft_logprobs(
                h, (positions + i)[:, None], cache, temperature, top_p, generator
            )
            if fixed is not None and bool(where[:, i].any()):
                token = torch.where(where[:, i], fixed[:, i], token)
                one_hot = torch.full_like(q, float("-inf"))
                one_hot.scatter_(1, token[:, None], 0.0)
                q = torch.where(where[:, i, None], one_hot, q)
            tokens.append(token)
            logprobs.append(q)
        return EarlyExitDraft(
            tokens=torch.stack(tokens, dim=1),
            logprobs=torch.stack(logprobs, dim=1),
            hidden=torch.cat(hidden, dim=1),
        )

    def verify_logits(
        self, draft: EarlyExitDraft, positions: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """Full-model logits [B, K+1, V] at positions .. positions+K, resuming at layer E."""
        k1 = draft.hidden.shape[1]
        pos = positions[:, None] + torch.arange(k1, device=positions.device)  # [B, K+1]
        layers = self.model.args.num_hidden_layers
        return self.model.head(
            self.model.run_layers(draft.hidden, pos, cache, self.exit_layer, layers)
        )

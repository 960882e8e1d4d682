"""Draft proposers for self-speculative decoding (DESIGN §2).

- :class:`EarlyExitDrafter`: the policy's own first ``exit_layer`` layers + final norm + LM head
  draft ``k`` tokens. Their KV-cache slots are the full model's slots for those layers (same
  weights, same inputs), so verification resumes the drafted hidden states at layer
  ``exit_layer`` instead of recomputing the early layers.
- :class:`NgramDrafter`: proposals copied from history — the prompt, the other completions of the
  same prompt (the GRPO group) and earlier completions of it — by matching the longest suffix of
  the row's context. Deterministic drafts (q is one-hot), no forward pass. ``sources`` picks how
  much history it may copy from (:data:`NGRAM_SOURCES`), so a benchmark can tell drafting from
  the replay of earlier answers.

Both return what the rejection sampler needs; the verify forward and the acceptance rule live in
the engine and in :mod:`actors.speculative`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.model import KVCache, Transformer
from common.sampling import processed_logprobs, sample_tokens


@dataclass
class EarlyExitDraft:
    tokens: torch.Tensor  # [B, K] int64 drafted tokens d_1..d_K
    logprobs: torch.Tensor  # [B, K, V] processed draft log q at positions 0..K-1
    hidden: torch.Tensor  # [B, K + 1, H] residual stream after layer E for last token, d_1..d_K


class EarlyExitDrafter:
    """Drafts with the first ``exit_layer`` layers of the policy itself."""

    def __init__(self, model: Transformer, exit_layer: int) -> None:
        layers = model.args.num_hidden_layers
        if not 1 <= exit_layer < layers:
            raise ValueError(
                f"spec.exit_layer={exit_layer} must be in [1, {layers - 1}] for a "
                f"{layers}-layer model (the draft must be cheaper than the model)"
            )
        self.model = model
        self.exit_layer = exit_layer

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
                break  # the last draft only needs its early layers, for verification
            q = processed_logprobs(self.model.head(h)[:, 0], temperature, top_p)  # [B, V]
            token, _ = sample_tokens(q, generator)
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


NgramIndex = dict[tuple[int, ...], tuple[Sequence[int], int]]
"""n-gram -> (source sequence, index of the token that followed its last occurrence)."""


def index_ngrams(index: NgramIndex, seq: Sequence[int], min_n: int, max_n: int) -> None:
    """Add every n-gram of ``seq`` that has a successor; later occurrences overwrite earlier ones.
    Only n-grams with a successor are indexed, so a row's own suffix never matches itself."""
    for n in range(min_n, max_n + 1):
        for start in range(len(seq) - n):
            index[tuple(seq[start : start + n])] = (seq, start + n)


NGRAM_SOURCES = ("prompt", "group", "history")
"""What an :class:`NgramDrafter` copies from, each level adding to the one before: ``prompt`` =
the row's own prompt and completion so far (vLLM's built-in ``ngram``); ``group`` = also the other
rows of the batch with the same prompt (the GRPO group); ``history`` = also earlier completions
of the prompt (from earlier epochs over a training set)."""


class NgramDrafter:
    """Longest-suffix match against the tokens of the same prompt: the row's own context, the
    rows of the batch that share its prompt (the GRPO group) and a bounded memory of earlier
    completions per prompt (``history_prompts`` prompts kept, LRU, the newest ``per_prompt`` to
    ``2 * per_prompt`` completions each), as far as ``sources`` allows."""

    def __init__(
        self,
        max_n: int,
        min_n: int,
        history_prompts: int = 4096,
        per_prompt: int = 16,
        sources: str = "history",
    ):
        if sources not in NGRAM_SOURCES:
            raise ValueError(f"n-gram sources must be one of {NGRAM_SOURCES}, got {sources!r}")
        self.max_n = max_n
        self.min_n = min_n
        self.sources = sources
        self.history_prompts = history_prompts
        self.per_prompt = per_prompt
        # prompt key -> (earlier prompt + completion sequences, their n-gram index)
        self._history: OrderedDict[str, tuple[list[list[int]], NgramIndex]] = OrderedDict()
        # The rows of the batch being decoded (see begin): row id -> the tokens indexed so far,
        # and the incremental index they feed (per prompt key, or per row for "prompt").
        self._live_rows: dict[int, list[int]] = {}
        self._live_index: dict[str | int, NgramIndex] = {}

    def begin(self) -> None:
        """A new batch starts: forget the rows of the previous one (``propose`` with ``row_ids``
        indexes each row's new tokens only, instead of every n-gram of every row every step)."""
        self._live_rows = {}
        self._live_index = {}

    def forget(self) -> None:
        """Drop every earlier completion (the next visit of any prompt is a first visit)."""
        self._history.clear()

    def history(self, prompt_key: str) -> list[list[int]]:
        return self._history[prompt_key][0] if prompt_key in self._history else []

    def remember(self, prompt_key: str, sequence: Sequence[int]) -> None:
        """Keep a finished prompt + completion as a draft source for later samples of the prompt
        (only when ``sources`` is ``history``: the other levels never read it)."""
        if self.sources != "history":
            return
        seqs, index = self._history.setdefault(prompt_key, ([], {}))
        self._history.move_to_end(prompt_key)
        seqs.append(list(sequence))
        index_ngrams(index, seqs[-1], self.min_n, self.max_n)
        if len(seqs) > 2 * self.per_prompt:
            # Amortised eviction: keep the newest per_prompt sequences and re-index them, so old
            # completions stop proposing drafts without a rebuild on every call.
            del seqs[: -self.per_prompt]
            index.clear()
            for seq in seqs:
                index_ngrams(index, seq, self.min_n, self.max_n)
        while len(self._history) > self.history_prompts:
            self._history.popitem(last=False)

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        prompt_keys: Sequence[str],
        k: int,
        row_ids: Sequence[int] | None = None,
    ) -> list[list[int]]:
        """Up to ``k`` draft tokens per row: what followed the longest suffix of the row's context
        (``max_n`` down to ``min_n`` tokens) in any source of the same prompt.

        With ``row_ids`` (stable ids of the rows since :meth:`begin`) the batch's n-grams are
        indexed incrementally; without them they are indexed afresh on every call."""
        if row_ids is not None:
            return self._propose_live(contexts, prompt_keys, k, row_ids)
        if self.sources == "prompt":
            drafts = []
            for context in contexts:
                own: NgramIndex = {}
                index_ngrams(own, context, self.min_n, self.max_n)
                drafts.append(self._lookup(context, (own,), k))
            return drafts
        # Per prompt: an index of the batch rows' n-grams, looked up before the cached index of
        # earlier completions (the group's current tokens are the freshest evidence).
        batch_index: dict[str, NgramIndex] = {}
        for key, context in zip(prompt_keys, contexts, strict=True):
            index_ngrams(batch_index.setdefault(key, {}), context, self.min_n, self.max_n)
        empty: NgramIndex = {}
        drafts = []
        for key, context in zip(prompt_keys, contexts, strict=True):
            history = self._history.get(key) if self.sources == "history" else None
            indexes = (batch_index[key], history[1] if history is not None else empty)
            drafts.append(self._lookup(context, indexes, k))
        return drafts

    def _propose_live(
        self,
        contexts: Sequence[Sequence[int]],
        prompt_keys: Sequence[str],
        k: int,
        row_ids: Sequence[int],
    ) -> list[list[int]]:
        slots: list[str | int] = []
        for row, key, context in zip(row_ids, prompt_keys, contexts, strict=True):
            slot = row if self.sources == "prompt" else key
            slots.append(slot)
            index = self._live_index.setdefault(slot, {})
            seen = self._live_rows.get(row)
            if seen is None or len(context) < len(seen) or list(context[: len(seen)]) != seen:
                # New row, or its tokens were rolled back (weights verified in flight): index it
                # again. A row's own index starts afresh; in a group's, entries of the dropped
                # tokens stay (they are only proposals, and the other rows' are still valid).
                seen = self._live_rows[row] = []
                if self.sources == "prompt":
                    index.clear()
            # Each new token gives a successor to the n-grams that end just before it.
            for i in range(len(seen), len(context)):
                seen.append(int(context[i]))
                for n in range(self.min_n, min(self.max_n, i) + 1):
                    index[tuple(seen[i - n : i])] = (seen, i)
        empty: NgramIndex = {}
        drafts = []
        for slot, key, context in zip(slots, prompt_keys, contexts, strict=True):
            history = self._history.get(key) if self.sources == "history" else None
            indexes = (self._live_index[slot], history[1] if history is not None else empty)
            drafts.append(self._lookup(context, indexes, k))
        return drafts

    def _lookup(self, context: Sequence[int], indexes: tuple[NgramIndex, ...], k: int) -> list[int]:
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            suffix = tuple(context[-n:])
            for index in indexes:
                hit = index.get(suffix)
                if hit is not None:
                    seq, follow = hit
                    return list(seq[follow : follow + k])
        return []

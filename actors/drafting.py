"""Draft proposers for self-speculative decoding (docs/design.md §2.1): :class:`EarlyExitDrafter`
(the policy's first ``exit_layer`` layers, whose KV slots are the full model's, so verification
resumes at that layer), :class:`EagleDrafter` (the policy's EAGLE-3 head, common/eagle.py) and
:class:`NgramDrafter` (copies from the prompt, the GRPO group and earlier completions; one-hot q,
no forward). They return what the rejection sampler needs; the verify forward and the acceptance
rule live in the engine and in :mod:`actors.speculative`.
"""

from __future__ import annotations

from bisect import insort
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.config.modes import NGRAM_SOURCES
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


NgramIndex = dict[tuple[int, ...], tuple[Sequence[int], int]]
"""n-gram -> (source sequence, index of the token that followed its last occurrence)."""


def index_ngrams(index: NgramIndex, seq: Sequence[int], min_n: int, max_n: int) -> None:
    """Add every n-gram of ``seq`` that has a successor; later occurrences overwrite earlier ones.
    Only n-grams with a successor are indexed, so a row's own suffix never matches itself."""
    for n in range(min_n, max_n + 1):
        for start in range(len(seq) - n):
            index[tuple(seq[start : start + n])] = (seq, start + n)


class NgramDrafter:
    """Longest-suffix match against the tokens of the same prompt: the row's own context, the
    rows that share its prompt (the GRPO group) and a bounded memory of earlier completions per
    prompt, as far as ``sources`` allows.

    Rows are followed incrementally: :meth:`add_row` indexes a row's prompt once, :meth:`extend`
    indexes only the tokens added, :meth:`truncate` (a rollback, rare) re-indexes that row alone,
    and :meth:`propose_rows` looks up suffixes, so the work per step grows with the tokens added,
    not with the context. Lookup rule, for the longest suffix first (``max_n`` down to ``min_n``):
    the row's own latest occurrence, else the other rows of its prompt in row-id order (each its
    latest occurrence), else the history. :meth:`propose` applies the same rule to contexts
    indexed from scratch (``tests/unit/actors`` checks that both give the same drafts).

    The key rows and history are found under is the prompt's (``generate``) or the task's
    (``serve``: a turn's ``draft_key``, since siblings' histories differ after their first turn;
    a turn's context is the episode's whole history, so an environment's output, a tool's
    answer, is a draft source too). ``serve`` never begins a new call: it drops each row when
    its turn is delivered (:meth:`drop_row`) and remembers each episode once, when it ends.
    """

    history_prompts = 4096  # prompts whose earlier completions are kept (LRU)
    per_prompt = 16  # earlier completions kept per prompt: the newest per_prompt to 2 * per_prompt

    def __init__(self, max_n: int, min_n: int, sources: str = "history") -> None:
        if sources not in NGRAM_SOURCES:
            raise ValueError(f"n-gram sources must be one of {NGRAM_SOURCES}, got {sources!r}")
        self.max_n, self.min_n, self.sources = max_n, min_n, sources
        # prompt key -> (earlier prompt + completion sequences, their n-gram index)
        self._history: OrderedDict[str, tuple[list[list[int]], NgramIndex]] = OrderedDict()
        # Rows followed since begin(): id -> (prompt key, tokens so far, their n-gram index), and
        # per prompt key the ids of its rows, ascending.
        self._rows: dict[int, tuple[str, list[int], NgramIndex]] = {}
        self._groups: dict[str, list[int]] = {}

    def begin(self) -> None:
        """A new call starts: forget the rows of the previous one."""
        self._rows = {}
        self._groups = {}

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

    # ------------------------------------------------------------------ incremental rows

    def add_row(self, row: int, prompt_key: str, context: Sequence[int]) -> None:
        """Follow row ``row`` (its context so far, usually its prompt); a known row restarts."""
        if row not in self._rows:
            group = self._groups.setdefault(prompt_key, [])
            insort(group, row)
        self._rows[row] = (prompt_key, [], {})
        self.extend(row, context)

    def drop_row(self, row: int) -> None:
        """Stop following row ``row`` (its turn is over): it drafts and is drafted from no more."""
        held = self._rows.pop(row, None)
        if held is None:
            return
        group = self._groups[held[0]]
        group.remove(row)
        if not group:
            del self._groups[held[0]]

    def rows(self) -> int:
        """How many rows are followed."""
        return len(self._rows)

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        """Append tokens to a row: each gives a successor to the n-grams that end before it."""
        _, seq, index = self._rows[row]
        lo, hi = self.min_n, self.max_n
        for token in tokens:
            i = len(seq)
            seq.append(int(token))
            for n in range(lo, min(hi, i) + 1):
                index[tuple(seq[i - n : i])] = (seq, i)

    def truncate(self, row: int, length: int) -> None:
        """Roll a row back to its first ``length`` tokens (re-indexes that row only)."""
        key, seq, _ = self._rows[row]
        if length < len(seq):
            kept = seq[:length]
            self._rows[row] = (key, [], {})
            self.extend(row, kept)

    def propose_rows(self, rows: Sequence[int], k: int) -> list[list[int]]:
        """Up to ``k`` draft tokens for each followed row (see the class docstring)."""
        return [self._lookup_row(row, k) for row in rows]

    def _sources_of(self, row: int) -> list[NgramIndex]:
        key, _, own = self._rows[row]
        indexes = [own]
        if self.sources != "prompt":
            indexes += [self._rows[r][2] for r in self._groups[key] if r != row]
        if self.sources == "history":
            history = self._history.get(key)
            if history is not None:
                indexes.append(history[1])
        return indexes

    def _lookup_row(self, row: int, k: int) -> list[int]:
        context = self._rows[row][1]
        indexes = None
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            suffix = tuple(context[-n:])
            if indexes is None:
                indexes = self._sources_of(row)
            for index in indexes:
                hit = index.get(suffix)
                if hit is not None:
                    seq, follow = hit
                    return list(seq[follow : follow + k])
        return []

    # ------------------------------------------------------------------ whole contexts

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        prompt_keys: Sequence[str],
        k: int,
        row_ids: Sequence[int] | None = None,
    ) -> list[list[int]]:
        """Up to ``k`` draft tokens per context: the lookup rule of the class docstring over the
        given contexts (a context's group: the other contexts with its prompt key, in order).

        Without ``row_ids`` every context is indexed afresh (nothing is kept). With them (stable
        ids since :meth:`begin`) the rows are followed incrementally: a context that extends what
        the row held indexes only its new tokens; one that does not restarts the row."""
        if row_ids is None:
            scratch = NgramDrafter(self.max_n, self.min_n, sources=self.sources)
            scratch._history = self._history
            for i, (key, context) in enumerate(zip(prompt_keys, contexts, strict=True)):
                scratch.add_row(i, key, context)
            return scratch.propose_rows(range(len(contexts)), k)
        for row, key, context in zip(row_ids, prompt_keys, contexts, strict=True):
            held = self._rows.get(row)
            seen = held[1] if held is not None else None
            if seen is None or held[0] != key or list(context[: len(seen)]) != seen:
                self.add_row(row, key, context)
            else:
                self.extend(row, context[len(seen) :])
        return self.propose_rows(row_ids, k)

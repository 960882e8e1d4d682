"""The n-gram drafter (docs/design.md §2.1): copies from the prompt, the GRPO group and earlier
completions; a one-hot q, no forward."""

from __future__ import annotations

from bisect import insort
from collections import OrderedDict
from collections.abc import Sequence

from common.config.modes import NGRAM_SOURCES

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

"""A fixed draft length (``spec.adaptive=false``): every decoding step drafts ``spec.k`` tokens
with the drafters the engine has, the choice :class:`~actors.decoding.draft_length.DraftLength`
makes by measurement made once and for all. The torch engine's decoder dispatches every step on
a :class:`Choice` from one of the two, so a fixed k is a fixed choice, not a second code path.

The rule: the EAGLE-3 head drafts when there is one; with both the early exit and n-gram
drafting (``hybrid``) a step is an n-gram step when every row has a match, otherwise an early
exit step drafting each row's match first; one drafter alone drafts; none, a plain step. It
depends on the tokens so far only (the match lengths), so every choice stays exact."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from actors.decoding.draft_length import EAGLE, EARLY_EXIT, NGRAM, PLAIN_STEP, Choice, StepOutcome


class FixedLength:
    """Always ``k`` with the drafters present; learns nothing and times nothing."""

    adaptive = False

    def __init__(self, k: int, *, early_exit: bool, ngram: bool, eagle: bool) -> None:
        self.k = k
        if eagle:
            self._choice: Choice | None = Choice(EAGLE, k)
        elif early_exit and not ngram:
            self._choice = Choice(EARLY_EXIT, k)
        elif ngram and not early_exit:
            self._choice = Choice(NGRAM, k)
        elif not ngram:
            self._choice = PLAIN_STEP
        else:
            self._choice = None  # hybrid: decided per step from the match lengths

    def choose(
        self, rows: int, matches: Sequence[int] | Callable[[], Sequence[int]] | None = None
    ) -> Choice:
        choice = self._choice
        if choice is None or choice.kind == NGRAM:
            lengths = matches() if callable(matches) else matches  # fills the step's drafts
            if choice is None:  # hybrid: an n-gram step only if every row has a match
                assert lengths is not None, "hybrid needs each row's n-gram match length"
                choice = Choice(NGRAM, self.k)
                if not all(lengths):
                    choice = Choice(EARLY_EXIT, self.k, ngram_prefix=True)
        return choice

    def learn(self, step: StepOutcome) -> None:
        """Nothing to learn: the choice is fixed."""

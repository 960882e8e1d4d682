"""``lookup``: the CPU test task of multi-turn episodes, for the built-in char model.

An episode (``env.name=lookup``, ``actors/episodes/builtin.py``)::

    prompt        find qz>          a two-letter key
    model turn 1  get qz<EOS>       the tool call
    environment   =483920>          the key's value: digits drawn from the problem's seed
    model turn 2  483920<EOS>       the answer; reward 1 when it is the value

Any other turn is a malformed call (``=bad>``) and the model may try again, up to the
environment's ``max_turns``. The value is random per problem, so a correct answer can only be
copied from the environment's tokens. Every character is in ``BUILTIN_ALPHABET``.

:class:`LookupTask` is the same problem as a task (``task=lookup``): its prompts, and
demonstrations as segments for the tiny model's warm start, the environment's span masked (a
model never learns to predict a random value). Its single-turn reward scores the first turn
only (the tool call), which is what the warm start's sampled reward measures.
"""

from __future__ import annotations

import random
import string

from common.tasks import Problem

DIGITS = 6
"""Digits of a value (the environment's default)."""
BAD = "=bad>"
"""The observation after a malformed action."""


def draw(rng: random.Random, digits: int = DIGITS) -> tuple[str, str]:
    """A problem: (key, value)."""
    key = "".join(rng.choice(string.ascii_lowercase) for _ in range(2))
    value = "".join(rng.choice(string.digits) for _ in range(digits))
    return key, value


PROMPT, CALL, RESULT = "find {}>", "get {}", "={}>"
"""The prompt of a key, the tool call of a key, the tool's answer of a value (``str.format``)."""


class LookupTask:
    """``task=lookup``: the lookup problem as prompts and segmented demonstrations (module
    docstring). ``min_digits``, ``max_digits`` and ``partial_credit`` are the digit tasks'
    settings, taken and unused: a value always has :data:`DIGITS` digits."""

    name = "lookup"
    max_new_tokens = 2 * (DIGITS + 2)

    def __init__(self, min_digits: int = 1, max_digits: int = 1, partial_credit: float = 0.0):
        del min_digits, max_digits, partial_credit

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            key, value = draw(rng)
            out.append(Problem(f"lookup-{key}-{value}", PROMPT.format(key), value))
        return out

    def reward(self, problem: Problem, completion: str) -> float:
        """The first turn alone: 1 for the right tool call."""
        return float(completion == CALL.format(problem.prompt[5:7]))

    def demonstration(self, problem: Problem, rng: random.Random | None = None) -> str:
        raise NotImplementedError("lookup's demonstrations are segments: demonstration_segments")

    def demonstration_segments(
        self, problem: Problem, rng: random.Random | None = None
    ) -> list[tuple[str, bool]]:
        """(text, trained) in order: the call and the answer are the model's (each followed by
        EOS), the value the environment's (masked)."""
        key = problem.prompt[5:7]
        return [
            (CALL.format(key), True),
            (RESULT.format(problem.answer), False),
            (problem.answer, True),
        ]

"""Built-in environments, named by ``env.name`` (:data:`BUILTIN`).

``lookup`` (the CPU test task of the built-in char model, ``common/lookup.py``): the prompt names a two-letter key
(``find qz>``); the tool call ``get qz`` returns the key's value, six digits drawn from the
episode's seed (``=483920>``); the answer is the value itself. Anything else is a malformed
action (``=bad>``, ``info["malformed"]``) and the model may try again, up to ``max_turns``
turns. Since the value is random per problem, a correct answer can only be copied from the
environment's tokens. Every character is in ``common.tokenizer.BUILTIN_ALPHABET``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from common.lookup import BAD, CALL, PROMPT, RESULT, draw


class LookupEnv:
    """``find <key>>`` -> ``get <key>`` -> ``=<value>>`` -> ``<value>`` (reward 1)."""

    def __init__(self, digits: int = 6, max_turns: int = 3, partial_credit: float = 0.0) -> None:
        if not 1 <= digits <= 12:
            raise ValueError(f"lookup: digits must be in 1..12, got {digits}")
        if max_turns < 1:
            raise ValueError(f"lookup: max_turns must be >= 1, got {max_turns}")
        if not 0.0 <= partial_credit < 1.0:
            raise ValueError(f"lookup: partial_credit must be in [0, 1), got {partial_credit}")
        self.digits = digits
        self.max_turns = max_turns
        self.partial_credit = partial_credit
        self.key = ""
        self.value = ""
        self.turns = 0

    def reset(self, *, seed: int, options: Mapping[str, Any] | None = None) -> tuple[str, dict]:
        """A new problem drawn from ``seed`` alone (siblings that share it get the same one)."""
        self.key, self.value = draw(random.Random(seed), self.digits)
        self.turns = 0
        return PROMPT.format(self.key), {"key": self.key}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if not self.key:
            raise RuntimeError("lookup: step before reset")
        self.turns += 1
        text = action.strip()
        out_of_turns = self.turns >= self.max_turns
        if text == CALL.format(self.key):
            return RESULT.format(self.value), 0.0, False, out_of_turns, {"malformed": False}
        if text.isdigit():
            return "", self._reward(text), True, False, {"malformed": False}
        return BAD, 0.0, False, out_of_turns, {"malformed": True}

    def _reward(self, answer: str) -> float:
        if answer == self.value:
            return 1.0
        if not self.partial_credit or len(answer) != len(self.value):
            return 0.0
        same = sum(a == b for a, b in zip(answer, self.value, strict=True))
        return self.partial_credit * same / len(self.value)


BUILTIN: dict[str, type] = {"lookup": LookupEnv}
"""The built-in environments by ``env.name`` (``common.config.env.BUILTIN_ENVS`` lists the
names, for the config check)."""

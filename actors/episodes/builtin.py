"""Built-in environments, named by ``env.name`` (:data:`BUILTIN`).

``lookup`` (the CPU test task of the built-in char model, ``common/lookup.py``): the prompt names a two-letter key
(``find qz>``); the tool call ``get qz`` returns the key's value, six digits drawn from the
episode's seed (``=483920>``); the answer is the value itself. Anything else is a malformed
action (``=bad>``, ``info["malformed"]``) and the model may try again, up to ``max_turns``
turns. Since the value is random per problem, a correct answer can only be copied from the
environment's tokens. Every character is in ``common.tokenizer.BUILTIN_ALPHABET``.

``guess_number`` (the real-model learning task, ``common/guess_number.py``): guess a number in
[lo, hi] told ``Higher.`` or ``Lower.``, within T = ceil(log2(n + 1)) + 1 turns; the episode's
seed picks the instance from the training pool (or, with ``split=held_out``, the held-out set).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from common import guess_number as gn
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


class GuessNumberEnv:
    """The guessing game of ``common/guess_number.py``: the prompt names the range, each turn's
    first integer is the guess, ``Higher.`` / ``Lower.`` answer it; a correct guess ends the
    episode with reward 1 (``turn_discount ** (turn - 1)`` with an opt-in discount), T turns
    without one end it truncated with 0.

    ``pool_size`` / ``pool_seed``: the training pool the seed indexes (``task.pool_seed``; 0 as
    pool size: every seed draws its own instance); ``split=held_out``: the held-out set instead."""

    def __init__(
        self,
        pool_size: int = gn.POOL_SIZE,
        pool_seed: int = gn.POOL_SEED,
        split: str = "train",
        turn_discount: float = 1.0,
    ) -> None:
        if split not in gn.SPLITS:
            raise ValueError(f"guess_number: split must be one of {gn.SPLITS}, got {split!r}")
        if pool_size < 0:
            raise ValueError(f"guess_number: pool_size must be >= 0, got {pool_size}")
        if not 0.0 < turn_discount <= 1.0:
            raise ValueError(f"guess_number: turn_discount must be in (0, 1], got {turn_discount}")
        self.pool_size, self.pool_seed, self.split = pool_size, pool_seed, split
        self.turn_discount = turn_discount
        self.instance: gn.Instance | None = None
        self.turns = 0

    def reset(self, *, seed: int, options: Mapping[str, Any] | None = None) -> tuple[str, dict]:
        """The instance of ``seed`` (siblings that share it get the same one); an evaluation's
        episodes (``options["split"] == "eval"``) play the held-out set."""
        split = "held_out" if (options or {}).get("split") == "eval" else self.split
        self.instance = gn.instance(seed, split, self.pool_size, self.pool_seed)
        self.turns = 0
        lo, hi, _ = self.instance
        return gn.prompt(self.instance), {"lo": lo, "hi": hi, "turns": self.instance.turns}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.instance is None:
            raise RuntimeError("guess_number: step before reset")
        self.turns += 1
        guess = gn.parse_guess(action)
        obs, kind = gn.answer(self.instance, guess)
        info = {"malformed": kind == "malformed", "guess": guess, "feedback": kind}
        if kind == "correct":
            return obs, self.turn_discount ** (self.turns - 1), True, False, info
        return obs, 0.0, False, self.turns >= self.instance.turns, info


BUILTIN: dict[str, type] = {"lookup": LookupEnv, "guess_number": GuessNumberEnv}
"""The built-in environments by ``env.name`` (``common.config.env.BUILTIN_ENVS`` lists the
names, for the config check)."""

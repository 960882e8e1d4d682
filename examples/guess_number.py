"""A multi-turn environment (docs/environments.md): guess a number, told higher or lower.

specrl run model=smollm2-135m env.name=examples/guess_number.py:GuessNumber ...
"""

import random


class GuessNumber:
    """Guess a number in 1..100; the environment says higher or lower."""

    def __init__(self, high: int = 100, turns: int = 6):
        self.high, self.turns = high, turns

    def reset(self, *, seed, options):
        # seed: the problem's, shared by the G siblings of a group (same secret);
        # options["sibling"]: this sibling's index, for randomness of its own.
        self.secret = random.Random(seed).randint(1, self.high)
        self.left = self.turns
        return f"I picked a number between 1 and {self.high}. Guess it.", {}

    def step(self, action):
        # action: the model's turn as text (its end-of-turn token removed).
        self.left -= 1
        digits = "".join(c for c in action if c.isdigit())
        if not digits:
            return "Answer with a number.", 0.0, False, self.left == 0, {"malformed": True}
        guess = int(digits)
        if guess == self.secret:
            return "Correct!", 1.0, True, False, {}
        hint = "Higher." if guess < self.secret else "Lower."
        return hint, 0.0, False, self.left == 0, {}

    def close(self):
        pass

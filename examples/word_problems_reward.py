"""An example reward function for specrl, written as a user would write one.

It scores `task=word_problems` (or any data set whose answers are numbers) the way the built-in
reward does: the completion's final answer is the last number inside its last ``\\boxed{...}``,
else the first number after its last ``####``, else its last number; it earns 1.0 when that
number equals the reference answer exactly (``1,000`` = ``1000``, ``3.0`` = ``3``). It also
reports a second component, whether the answer was marked (boxed or after ``####``), which
``task.reward_weights`` can weigh in (0 by default here, so the reward is the correctness alone).

Run it on the real-model preset (README, "Your own reward"):

    specrl run model=smollm2-135m task=word_problems \\
        task.reward=examples/word_problems_reward.py:score '+task.reward_weights={marked: 0}'
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# "1,234.5", "1234.5", ".5", "-3"; a minus sign only where no digit precedes it ("10-3" is 10, 3).
NUMBER = re.compile(r"(?:(?<![\d.])-)?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|\d+(?:\.\d+)?|\.\d+)")


def last_boxed(text: str) -> str | None:
    """What the last complete ``\\boxed{...}`` holds (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 1, start + len("\\boxed{")
        while i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start + len("\\boxed{") : i]
            i += 1
        start = text.rfind("\\boxed{", 0, start)  # an unclosed box: try an earlier one
    return None


def final_answer(text: str) -> tuple[str | None, bool]:
    """The completion's final number and whether it was marked (boxed or after ``####``)."""
    boxed = last_boxed(text)
    if boxed is not None:
        numbers = NUMBER.findall(boxed)
        return (numbers[-1] if numbers else None), True
    marker = text.rfind("####")
    if marker != -1:
        found = NUMBER.search(text, marker + 4)
        return (found.group() if found else None), True
    numbers = NUMBER.findall(text)
    return (numbers[-1] if numbers else None), False


def as_number(text: str | None) -> Decimal | None:
    if text is None:
        return None
    try:
        value = Decimal(text.strip().replace(",", ""))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def score(prompt: str, completion: str, row: dict) -> dict[str, float]:
    answer, marked = final_answer(completion)
    got, expected = as_number(answer), as_number(str(row["answer"]))
    correct = got is not None and expected is not None and got == expected
    return {"correct": float(correct), "marked": float(marked)}

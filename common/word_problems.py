"""``task=word_problems``: arithmetic word problems in plain English, generated, never downloaded.

Each problem tells a short story about one person's count of some things and changes it in one
to three steps (gets more, gives some away, the count is doubled or tripled, the things are
shared out equally), then asks for the final count. Numbers stay small and every intermediate
count is a non-negative whole number, so the answer is one integer. A pretrained instruct model
asked through its chat template solves some of them (the one-step ones mostly) and fails the
rest, which is the regime where RL has a signal.

The training set is a fixed pool drawn with ``task.pool_seed``; the evaluation set
(:func:`eval_problems`) is drawn with another seed and shares no prompt with it. The reward is
:func:`~common.dataset_task.numeric_reward`, as for a data set.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from common.dataset_task import numeric_reward
from common.tasks import Problem

NAMES = (
    "Tom", "Anna", "Ben", "Maria", "Sam", "Lily", "Omar", "Grace", "Leo", "Nina",
    "Jack", "Emma", "Ravi", "Sofia", "Max", "Chloe", "Ivan", "Zoe", "Kofi", "Mei",
)  # fmt: skip
ITEMS = (
    "apples", "marbles", "stickers", "books", "cookies", "pencils", "coins", "cards",
    "shells", "stamps", "balloons", "eggs", "flowers", "toy cars", "beads", "candies",
)  # fmt: skip
FRIENDS = ("a friend", "a brother", "a sister", "a neighbour", "a classmate", "a cousin")
INSTRUCTION = "Give the final answer as a number."
MAX_START = 9
"""Largest starting count."""
MAX_ADD = 9
"""Largest number added or taken away in one step."""


@dataclass(frozen=True)
class _Step:
    """One change to the running count: the sentence that tells it and the new count."""

    text: str
    value: int


def _add(rng: random.Random, name: str, item: str, count: int) -> _Step:
    n = rng.randint(1, MAX_ADD)
    text = rng.choice(
        (
            f"Then {name} buys {n} more {item}.",
            f"Then {name} finds {n} more {item}.",
            f"Then {name} gets {n} more {item} as a gift.",
        )
    )
    return _Step(text, count + n)


def _sub(rng: random.Random, name: str, item: str, count: int) -> _Step | None:
    if count < 3:
        return None
    n = rng.randint(1, min(count - 1, MAX_ADD))
    friend = rng.choice(FRIENDS)
    text = rng.choice(
        (
            f"Then {name} gives {n} {item} to {friend}.",
            f"Then {name} loses {n} {item}.",
            f"Then {name} sells {n} {item}.",
        )
    )
    return _Step(text, count - n)


def _mul(rng: random.Random, name: str, item: str, count: int) -> _Step | None:
    if count > 30:
        return None
    factor = rng.choice((2, 3))
    word = {2: "doubles", 3: "triples"}[factor]
    return _Step(f"Then the number of {item} {name} has {word}.", count * factor)


def _div(rng: random.Random, name: str, item: str, count: int) -> _Step | None:
    parts = [p for p in (2, 3, 4, 5) if count % p == 0 and count // p >= 1]
    if not parts:
        return None
    p = rng.choice(parts)
    return _Step(
        f"Then {name} shares the {item} equally among {p} boxes and keeps only one box.",
        count // p,
    )


_OPS: tuple[Callable[[random.Random, str, str, int], _Step | None], ...] = (_add, _sub, _mul, _div)


def make_problem(rng: random.Random, steps: int) -> tuple[str, int]:
    """One story of ``steps`` changes: (question text, integer answer)."""
    name = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    count = rng.randint(2, MAX_START)
    sentences = [f"{name} has {count} {item}."]
    for _ in range(steps):
        while True:
            step = rng.choice(_OPS)(rng, name, item, count)
            if step is not None:
                break
        sentences.append(step.text)
        count = step.value
    sentences.append(f"How many {item} does {name} have now? {INSTRUCTION}")
    return " ".join(sentences), count


class WordProblemsTask:
    """Arithmetic word problems of ``min_steps``-``max_steps`` steps (uniform), with a numeric
    reward: 1.0 when the completion's final number equals the answer, else 0.0.

    Calibrated on SmolLM2-135M-Instruct at the preset's sampling temperature: about one problem
    in five of one step, fewer of two or three (``benchmarks/realmodel.py`` measures the held-out
    accuracy)."""

    name: ClassVar[str] = "word_problems"

    def __init__(self, min_steps: int = 1, max_steps: int = 3, max_new_tokens: int = 96) -> None:
        if not 1 <= min_steps <= max_steps:
            raise ValueError(
                f"need 1 <= min_steps <= max_steps, got min_steps={min_steps}, "
                f"max_steps={max_steps}"
            )
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.min_steps = min_steps
        self.max_steps = max_steps
        self.max_new_tokens = max_new_tokens

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` problems; fewer steps are likelier (step count s weighs max_steps - s + 1), so
        the model meets problems it can solve often enough for RL to have a signal."""
        counts = list(range(self.min_steps, self.max_steps + 1))
        weights = [self.max_steps - s + 1 for s in counts]
        problems = []
        for _ in range(n):
            text, answer = make_problem(rng, rng.choices(counts, weights)[0])
            digest = hashlib.sha1(text.encode()).hexdigest()[:16]
            problems.append(Problem(f"{self.name}:{digest}", text, str(answer)))
        return problems

    def reward(self, problem: Problem, completion: str) -> float:
        return numeric_reward(problem.answer, completion)

    def demonstration(self, problem: Problem, rng: random.Random | None = None) -> str:
        return f"#### {problem.answer}"

    def __repr__(self) -> str:
        return f"WordProblemsTask(steps={self.min_steps}-{self.max_steps})"


#: Seed of the held-out evaluation set (the training pool draws with ``task.pool_seed``).
EVAL_SEED = 1_000_003


def eval_problems(task: WordProblemsTask, n: int, exclude: list[Problem]) -> list[Problem]:
    """``n`` distinct problems drawn with :data:`EVAL_SEED`, none of whose prompts is in
    ``exclude`` (the training pool)."""
    seen = {p.prompt for p in exclude}
    rng = random.Random(EVAL_SEED)
    out: list[Problem] = []
    while len(out) < n:
        (problem,) = task.sample(rng, 1)
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            out.append(problem)
    return out

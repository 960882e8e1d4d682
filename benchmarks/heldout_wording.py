"""A wording family of arithmetic word problems that neither the warm start nor the task ever uses
(``real_eagle_heldout_wording_*`` in ``benchmarks/rollout.py``): a draft trained on
``task=word_problems`` (common/word_problems.py: a person, a count of small things, "Then ...",
"How many ... does ... have now?") is tried, as a new user would try it, on other sentence
templates about other nouns (shops, farms, libraries, trains; crates, loaves, passengers), asked
another way.

Nothing here shares a template, a noun or the question with common/word_problems.py;
``tests/unit/test_heldout_wording.py`` checks that.
"""

from __future__ import annotations

import random

PLACES = (
    ("bakery", "loaves"), ("library", "novels"), ("farm", "sheep"), ("garage", "tyres"),
    ("harbour", "boats"), ("school", "chairs"), ("museum", "paintings"), ("orchard", "crates"),
    ("station", "passengers"), ("zoo", "penguins"), ("warehouse", "parcels"), ("cafe", "mugs"),
)  # fmt: skip
OWNERS = ("the manager", "the owner", "the keeper", "the clerk", "the caretaker")
QUESTIONS = (
    "At the end of the day, what is the total number of {noun} at the {place}?",
    "Work out how many {noun} the {place} is left with.",
    "What number of {noun} does the {place} hold after all of this?",
)
INSTRUCTIONS = ("Reply with the number only.", "State the answer as a single number.")


def _change(rng: random.Random, place: str, noun: str, count: int) -> tuple[str, int]:
    """One change to the place's count: its sentence and the new count."""
    owner = rng.choice(OWNERS)
    choices = ["more", "fewer"]
    if count <= 20:
        choices.append("times")
    if any(count % p == 0 for p in (2, 4)):
        choices.append("half")
    kind = rng.choice(choices)
    if kind == "more" or count < 3:
        n = rng.randint(2, 12)
        text = rng.choice(
            (
                f"In the afternoon a delivery brings another {n} {noun}.",
                f"Later, {owner} adds {n} {noun} to the stock.",
                f"A van drops off {n} extra {noun} before noon.",
            )
        )
        return text, count + n
    if kind == "fewer":
        n = rng.randint(1, count - 1)
        text = rng.choice(
            (
                f"Over the morning, {n} of the {noun} are taken away.",
                f"{owner.capitalize()} removes {n} {noun} for repairs.",
                f"By lunch, {n} {noun} have been sent to another {place}.",
            )
        )
        return text, count - n
    if kind == "times":
        factor = rng.choice((2, 3))
        word = {2: "twice", 3: "three times"}[factor]
        return f"By evening the {place} has {word} as many {noun} as before.", count * factor
    part = 2 if count % 2 == 0 else 4
    word = {2: "half", 4: "a quarter"}[part]
    return f"Only {word} of the {noun} stay; the rest are moved out.", count // part


def make_problem(rng: random.Random, changes: int) -> tuple[str, int]:
    """One problem of ``changes`` changes: (text, integer answer)."""
    place, noun = rng.choice(PLACES)
    count = rng.randint(4, 24)
    sentences = [
        rng.choice(
            (
                f"A {place} starts the day with {count} {noun}.",
                f"This morning the {place} counted {count} {noun}.",
            )
        )
    ]
    for _ in range(changes):
        text, count = _change(rng, place, noun, count)
        sentences.append(text)
    question = rng.choice(QUESTIONS).format(noun=noun, place=place)
    sentences += [question, rng.choice(INSTRUCTIONS)]
    return " ".join(sentences), count


def problems(n: int, seed: int = 77) -> list[tuple[str, int]]:
    """``n`` distinct problems of 1-3 changes."""
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        text, answer = make_problem(rng, rng.randint(1, 3))
        if text not in seen:
            seen.add(text)
            out.append((text, answer))
    return out

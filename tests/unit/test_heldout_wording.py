"""The held-out wording family (benchmarks/heldout_wording.py) shares no template, noun, name or
question with the task's (common/word_problems.py), so a draft trained on the task meets it new."""

from __future__ import annotations

import random
import re

from benchmarks import heldout_wording
from common import word_problems


def task_texts(n: int) -> list[str]:
    rng = random.Random(0)
    return [word_problems.make_problem(rng, rng.randint(1, 3))[0] for _ in range(n)]


def test_no_word_of_the_tasks_vocabulary_appears():
    texts = [t for t, _ in heldout_wording.problems(300)]
    for word in (*word_problems.NAMES, *word_problems.ITEMS, *word_problems.FRIENDS):
        pattern = re.compile(rf"\b{re.escape(word)}\b", re.IGNORECASE)
        assert not any(pattern.search(t) for t in texts), word
    for text in texts:
        assert "Then " not in text and "How many" not in text
        assert word_problems.INSTRUCTION not in text


def test_no_sentence_is_shared_with_the_task():
    def sentences(texts):
        return {s.strip() for t in texts for s in re.split(r"(?<=[.?])\s+", t)}

    mine = sentences(t for t, _ in heldout_wording.problems(300))
    theirs = sentences(task_texts(3000))
    assert not mine & theirs


def test_problems_are_distinct_reproducible_and_answered_with_whole_numbers():
    first = heldout_wording.problems(200)
    assert first == heldout_wording.problems(200)
    assert len({t for t, _ in first}) == 200
    assert all(isinstance(a, int) and a >= 0 for _, a in first)
    assert heldout_wording.problems(5, seed=1) != heldout_wording.problems(5, seed=2)

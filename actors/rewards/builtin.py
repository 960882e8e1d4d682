"""The built-in tasks' rewards as reward functions (``fn(prompt=, completion=, row=)``), to name
in ``task.reward`` or to call from your own function (add a format bonus to the numeric check,
say): the same scoring the tasks use in process."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.dataset_task import numeric_reward
from common.tasks import exact_match_reward


def numeric_answer(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """``word_problems`` and data sets: 1.0 when the completion's final number equals
    ``row["answer"]`` numerically."""
    return numeric_reward(str(row["answer"]), completion)


def exact_match(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """``reverse``, ``addition``, ``scratchpad``: 1.0 when the completion is ``row["answer"]``
    (surrounding whitespace aside)."""
    return exact_match_reward(str(row["answer"]), completion)

"""Data set tasks: prompts with numeric answers read from a JSONL or Parquet file (GSM8K and MATH
style), and the numeric answer parsing their reward (and :mod:`common.word_problems`') uses: 1.0
when the final number of a completion equals the reference answer numerically.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, ClassVar

from common.config.modes import DATASET_SUFFIXES
from common.tasks import Problem

# A number: thousands-grouped ("1,234,567.5") or plain ("1234.5", ".5"). A minus sign counts only
# when it is not preceded by a digit, so "10-3" reads as 10 and 3, not 10 and -3.
_NUMBER = re.compile(r"(?:(?<![\d.])-)?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|\d+(?:\.\d+)?|\.\d+)")
_BOXED = "\\boxed{"
_FINAL_ANSWER_MARKER = "####"


def _last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None if there is none."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth = 1
        position = start + len(_BOXED)
        while position < len(text):
            if text[position] == "{":
                depth += 1
            elif text[position] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len(_BOXED) : position]
            position += 1
        # Unclosed box (e.g. a truncated completion): fall back to an earlier, complete one.
        start = text.rfind(_BOXED, 0, start)
    return None


def extract_numeric_answer(text: str) -> str | None:
    """The model's final number in ``text``, with thousands commas removed, or None.

    Preference: the last number inside the last ``\\boxed{...}``; else the first number after
    the last ``####`` (GSM8K format); else the last number anywhere. When a marker is present
    only the text it marks is searched, so a box or ``####`` without a number gives None rather
    than crediting some other number in the reasoning.
    """
    boxed = _last_boxed_content(text)
    if boxed is not None:
        numbers = _NUMBER.findall(boxed)
        return numbers[-1].replace(",", "") if numbers else None
    marker = text.rfind(_FINAL_ANSWER_MARKER)
    if marker != -1:
        match = _NUMBER.search(text, marker + len(_FINAL_ANSWER_MARKER))
        return match.group().replace(",", "") if match else None
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _parse_number(text: str) -> Decimal | None:
    """``text`` as an exact decimal (commas stripped), or None if it is not one finite number."""
    try:
        value = Decimal(text.strip().replace(",", ""))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def numeric_answers_equal(answer: str, predicted: str | None) -> bool:
    """Exact numeric equality: ``"1,000" == "1000"``, ``"3.0" == "3"``."""
    if predicted is None:
        return False
    expected = _parse_number(answer)
    got = _parse_number(predicted)
    return expected is not None and got is not None and expected == got


def numeric_reward(answer: str, completion: str) -> float:
    """1.0 if the final number of ``completion`` (:func:`extract_numeric_answer`) equals
    ``answer`` numerically, else 0.0."""
    return 1.0 if numeric_answers_equal(answer, extract_numeric_answer(completion)) else 0.0


class DatasetTask:
    """Prompts with numeric answers from a JSONL (one JSON object per line) or Parquet file, read
    from configurable columns; the answer column is read by :func:`reference_answer`.

    Every record is validated on load (blank JSONL lines are skipped, other keys and columns
    ignored); an error names the file and the line (JSONL, 1-based) or row (Parquet, 0-based).
    """

    name: ClassVar[str] = "dataset"

    def __init__(
        self,
        path: str | Path,
        max_new_tokens: int = 256,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        format: str = "auto",
        numeric_answers: bool = True,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.path = Path(path)
        self.max_new_tokens = max_new_tokens
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.format = dataset_format(self.path, format)
        if not self.path.is_file():
            raise FileNotFoundError(f"data set file {self.path} does not exist")
        self.numeric_answers = numeric_answers
        load = _load_parquet_problems if self.format == "parquet" else _load_jsonl_problems
        self.problems: list[Problem] = load(
            self.path, prompt_key, answer_key, self.name, numeric_answers
        )
        if not self.problems:
            raise ValueError(f"data set file {self.path} holds no problems")

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [self.problems[rng.randrange(len(self.problems))] for _ in range(n)]

    def reward(self, problem: Problem, completion: str) -> float:
        return numeric_reward(problem.answer, completion)

    def demonstration(self, problem: Problem, rng: random.Random | None = None) -> str:
        raise NotImplementedError(
            f"{type(self).__name__} ({self.path}) has no demonstrations: the file holds answers "
            "only, so a supervised warm start is not possible for it"
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={str(self.path)!r}, format={self.format!r}, "
            f"prompt_key={self.prompt_key!r}, answer_key={self.answer_key!r}, "
            f"problems={len(self.problems)})"
        )


class JsonlTask(DatasetTask):
    """:class:`DatasetTask` under the task name ``jsonl`` (prompt ids start with ``jsonl:``)."""

    name: ClassVar[str] = "jsonl"


def dataset_format(path: Path, format: str) -> str:
    """``jsonl`` or ``parquet``: ``format``, or for ``auto`` the one ``path``'s suffix names."""
    if format in ("jsonl", "parquet"):
        return format
    if format != "auto":
        raise ValueError(f"data set format must be auto, jsonl or parquet; got {format!r}")
    found = DATASET_SUFFIXES.get(path.suffix.lower())
    if found is None:
        raise ValueError(
            f"{path}: cannot tell the data set format from the suffix {path.suffix!r} "
            f"(known: {', '.join(DATASET_SUFFIXES)}); give the format (task.format=jsonl|parquet)"
        )
    return found


def _load_jsonl_problems(
    path: Path, prompt_key: str, answer_key: str, id_prefix: str, numeric_answers: bool
) -> list[Problem]:
    problems: list[Problem] = []
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record: Any = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: invalid JSON ({err.msg})") from err
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            problems.append(
                _problem_from_record(
                    record, where, prompt_key, answer_key, id_prefix, numeric_answers
                )
            )
    return problems


def _load_parquet_problems(
    path: Path, prompt_key: str, answer_key: str, id_prefix: str, numeric_answers: bool
) -> list[Problem]:
    # Imported here: only Parquet data sets need it.
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as err:  # pyarrow raises ArrowInvalid/OSError for a file that is not Parquet
        raise ValueError(f"{path}: not a readable Parquet file ({err})") from err
    for key in (prompt_key, answer_key):
        column = key.split(".", 1)[0]
        if column not in schema.names:
            raise ValueError(
                f"{path}: no column {column!r} (for {key!r}); the file's columns are "
                f"{', '.join(map(repr, schema.names))}"
            )
    rows = pq.read_table(path).to_pylist()  # every column: a reward function gets the row
    return [
        _problem_from_record(
            row, f"{path}: row {index}", prompt_key, answer_key, id_prefix, numeric_answers
        )
        for index, row in enumerate(rows)
    ]


_MISSING = object()


def _lookup(record: dict[str, Any], key: str) -> Any:
    """``record[key]``; a dotted key (``reward_model.ground_truth``) walks nested objects, unless
    the record holds the dotted name itself. ``_MISSING`` when absent."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def reference_answer(raw: str) -> str | None:
    """The number a data set's answer field stands for, or None if it holds none.

    A plain number (``"42"``, ``"1,000"``) is itself (answers compare numerically); a worked solution gives the number after
    its last ``####`` (GSM8K), or the content of its last ``\boxed{}`` when that is one number
    (MATH; ``\boxed{\frac{1}{2}}`` is not one, so it gives None rather than a wrong number).
    """
    text = raw.strip()
    if _parse_number(text) is not None:
        return text
    boxed = _last_boxed_content(text)
    if boxed is not None:
        content = boxed.strip().strip("$").strip()
        return content if _parse_number(content) is not None else None
    if _FINAL_ANSWER_MARKER in text:
        return extract_numeric_answer(text)
    return None


def _problem_from_record(
    record: dict[str, Any],
    where: str,
    prompt_key: str,
    answer_key: str,
    id_prefix: str,
    numeric_answers: bool = True,
) -> Problem:
    prompt = _lookup(record, prompt_key)
    if prompt is _MISSING:
        raise ValueError(f"{where}: missing {prompt_key!r} (the prompt; task.prompt_key)")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: {prompt_key!r} must be a non-empty string, got {prompt!r}")
    raw_answer = _lookup(record, answer_key)
    if raw_answer is _MISSING:
        raise ValueError(f"{where}: missing {answer_key!r} (the answer; task.answer_key)")
    # bool is an int subclass; true/false is never a meant numeric answer.
    if isinstance(raw_answer, bool) or not isinstance(raw_answer, str | int | float):
        raise ValueError(
            f"{where}: {answer_key!r} must be a string or a number, "
            f"got {type(raw_answer).__name__} {raw_answer!r}"
        )
    if isinstance(raw_answer, float) and not math.isfinite(raw_answer):
        raise ValueError(f"{where}: {answer_key!r} must be finite, got {raw_answer}")
    # The built-in reward is numeric, so an answer that is not a number could never be matched;
    # a user's reward (task.reward) takes the answer as it is.
    answer = reference_answer(str(raw_answer)) if numeric_answers else str(raw_answer)
    if answer is None:
        shown = raw_answer if len(str(raw_answer)) <= 80 else f"{str(raw_answer)[:77]}..."
        raise ValueError(
            f"{where}: {answer_key!r} {shown!r} has no number (expected a number, or a solution "
            "ending in '#### N' or '\\boxed{N}')"
        )
    digest = hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]
    return Problem(prompt_id=f"{id_prefix}:{digest}", prompt=prompt, answer=answer, row=record)

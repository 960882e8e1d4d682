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
from collections.abc import Iterator
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
    """Prompts with answers from a data set, read from configurable columns: a JSONL file (one
    JSON object per line), a Parquet file, an Arrow file or a directory ``datasets`` saved with
    ``save_to_disk`` (a ``DatasetDict``: its ``split``), the last two through ``datasets``. The
    built-in reward is numeric (the answer column is read by :func:`reference_answer`); with
    ``numeric_answers=False`` (a user's reward, ``task.reward``) answers are kept as they are.

    Every record is validated on load (blank JSONL lines are skipped, other keys and columns
    kept in the row a user's reward receives); an error names the file and the line (JSONL,
    1-based) or row (others, 0-based). Training draws every problem once per epoch, in an order
    shuffled anew each epoch. The held-out problems (:attr:`eval_problems`, for evaluation
    during training) are never drawn: a file of their own (``eval_path``), a split of a saved
    ``DatasetDict`` (``eval_split``), or the share ``eval_fraction`` of the prompts, chosen by a
    hash of the prompt text (the same on every actor and every run).
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
        split: str = "train",
        eval_path: str | Path = "",
        eval_split: str = "",
        eval_fraction: float = 0.0,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        self.path = Path(path)
        self.max_new_tokens = max_new_tokens
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.numeric_answers = numeric_answers
        self.format = dataset_format(self.path, format)
        problems = self._load(self.path, self.format, split)
        held_out: list[Problem] = []
        if eval_path:
            held_format = dataset_format(Path(eval_path), "auto")
            held_out = self._load(Path(eval_path), held_format, eval_split or "test")
        elif eval_split:
            held_out = self._load(self.path, self.format, eval_split)
        elif eval_fraction:
            held_out = [p for p in problems if _hash_share(p.prompt) < eval_fraction]
        held_prompts = {p.prompt for p in held_out}
        self.problems: list[Problem] = [p for p in problems if p.prompt not in held_prompts]
        self.eval_problems: list[Problem] = held_out
        if not self.problems:
            raise ValueError(f"data set {self.path} holds no problems to train on")
        self.epoch = 0
        self._order: list[int] = []
        self._cursor = 0

    def _load(self, path: Path, format: str, split: str) -> list[Problem]:
        if format == "disk":
            if not path.is_dir():
                raise FileNotFoundError(f"data set directory {path} does not exist")
        elif not path.is_file():
            raise FileNotFoundError(f"data set file {path} does not exist")
        keys = (self.prompt_key, self.answer_key)
        return [
            _problem_from_record(record, where, *keys, self.name, self.numeric_answers)
            for where, record in _LOADERS[format](path, split, keys)
        ]

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """The next ``n`` problems of the epoch (each training problem once per epoch, in an
        order ``rng`` shuffles when the epoch starts); a draw can span two epochs."""
        drawn: list[Problem] = []
        while len(drawn) < n:
            if self._cursor == len(self._order):
                self._order = list(range(len(self.problems)))
                rng.shuffle(self._order)
                self._cursor = 0
                self.epoch += 1
            take = min(n - len(drawn), len(self._order) - self._cursor)
            drawn += [self.problems[i] for i in self._order[self._cursor : self._cursor + take]]
            self._cursor += take
        return drawn

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
            f"problems={len(self.problems)}, held_out={len(self.eval_problems)})"
        )


def _hash_share(text: str) -> float:
    """A number in [0, 1) fixed by ``text`` (its SHA-256): which prompts a fraction holds out."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64


class JsonlTask(DatasetTask):
    """:class:`DatasetTask` under the task name ``jsonl`` (prompt ids start with ``jsonl:``)."""

    name: ClassVar[str] = "jsonl"


def dataset_format(path: Path, format: str) -> str:
    """``jsonl`` or ``parquet``: ``format``, or for ``auto`` the one ``path``'s suffix names."""
    if format in _LOADERS:
        return format
    if format != "auto":
        raise ValueError(f"data set format must be auto, {', '.join(_LOADERS)}; got {format!r}")
    if path.is_dir():
        return "disk"
    found = DATASET_SUFFIXES.get(path.suffix.lower())
    if found is None:
        raise ValueError(
            f"{path}: cannot tell the data set format from the suffix {path.suffix!r} "
            f"(known: {', '.join(DATASET_SUFFIXES)}); give the format (task.format=jsonl|parquet)"
        )
    return found


Records = Iterator[tuple[str, dict[str, Any]]]
"""A data set's records, each with where it stands (``file:line``, ``file: row N``) for errors."""


def _jsonl_records(path: Path, split: str, keys: tuple[str, str]) -> Records:
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
            yield where, record


def _parquet_records(path: Path, split: str, keys: tuple[str, str]) -> Records:
    # Imported here: only Parquet data sets need it.
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as err:  # pyarrow raises ArrowInvalid/OSError for a file that is not Parquet
        raise ValueError(f"{path}: not a readable Parquet file ({err})") from err
    _require_columns(path, schema.names, *keys)
    rows = pq.read_table(path).to_pylist()  # every column: a reward function gets the row
    return ((f"{path}: row {index}", row) for index, row in enumerate(rows))


def _datasets_records(path: Path, split: str, keys: tuple[str, str]) -> Records:
    """An Arrow file (``datasets``' own format) or a ``save_to_disk`` directory, through
    ``datasets``; a ``DatasetDict`` directory gives its ``split``."""
    import datasets  # only these formats need it

    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = datasets.Dataset.from_file(str(path))
    except Exception as err:  # datasets raises FileNotFoundError/ValueError/ArrowInvalid
        raise ValueError(f"{path}: not a data set datasets can read ({err})") from err
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(
                f"{path}: no split {split!r} (task.split / task.eval_split); it holds "
                f"{', '.join(map(repr, loaded))}"
            )
        loaded = loaded[split]
    _require_columns(path, loaded.column_names, *keys)
    return ((f"{path}: row {index}", dict(row)) for index, row in enumerate(loaded))


def _require_columns(path: Path, columns: list[str], *keys: str) -> None:
    """Every key's top-level column is among ``columns``, or a ValueError naming them."""
    for key in keys:
        column = key.split(".", 1)[0]
        if column not in columns:
            raise ValueError(
                f"{path}: no column {column!r} (for {key!r}); the data set's columns are "
                f"{', '.join(map(repr, columns))}"
            )


_LOADERS = {
    "jsonl": _jsonl_records,
    "parquet": _parquet_records,
    "arrow": _datasets_records,
    "disk": _datasets_records,
}

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

"""Prompt sources and exact reward functions.

A :class:`Task` samples :class:`Problem`s with a caller-owned ``random.Random`` (so actors are
reproducible from a seed) and scores a completion with a deterministic, verifiable reward in
``[0, 1]``. The completion passed to ``reward`` is the decoded generated text up to, and
excluding, EOS.

Built-in tasks (:class:`ReverseTask`, :class:`AdditionTask`, :class:`ScratchpadTask`) only use
characters of
:data:`~common.tokenizer.BUILTIN_ALPHABET`, so a :class:`~common.tokenizer.CharTokenizer` over it
can encode every prompt and answer. :class:`DatasetTask` (also named ``jsonl``) reads prompts
with numeric answers from a JSONL or Parquet file (GSM8K and MATH style).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import random
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from common.config import DATASET_SUFFIXES, TaskConfig


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer."""

    prompt_id: str
    """Stable id: the same problem always gets the same id (used to group completions)."""
    prompt: str
    """Text fed to the model, e.g. ``"123+45="``."""
    answer: str
    """Reference answer, e.g. ``"168"``."""


@runtime_checkable
class Task(Protocol):
    """A prompt source with an exact reward."""

    name: str
    """Short name, as given to :func:`make_task`."""
    max_new_tokens: int
    """Generation budget for one completion of this task (room for the answer and EOS)."""

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` problems drawn with ``rng`` only (deterministic given its state)."""
        ...

    def reward(self, problem: Problem, completion: str) -> float:
        """Score of ``completion`` (decoded text before EOS) for ``problem``, in ``[0, 1]``."""
        ...

    def demonstration(self, problem: Problem, rng: random.Random | None = None) -> str:
        """An ideal completion (for a supervised warm start); may raise NotImplementedError.
        Tasks whose solutions can be written several ways draw the way with ``rng`` (None: one
        canonical way)."""
        ...


# ---------------------------------------------------------------------------------------------
# Built-in tasks: exact string answers, optional dense partial credit.
# ---------------------------------------------------------------------------------------------


def exact_match_reward(answer: str, completion: str, partial_credit: float = 0.0) -> float:
    """1.0 if ``completion`` equals ``answer`` after stripping surrounding whitespace.

    Otherwise ``partial_credit * matches / max(len(answer), len(completion))``, where ``matches``
    counts positions ``i`` with ``answer[i] == completion[i]``; dividing by the longer length
    penalises a too-short or too-long completion. Always below 1.0 for a wrong answer when
    ``partial_credit <= 1``, so a correct answer stays strictly the best.
    """
    completion = completion.strip()
    if completion == answer:
        return 1.0
    if partial_credit <= 0.0 or not completion:
        return 0.0
    matches = sum(a == c for a, c in zip(answer, completion, strict=False))
    return partial_credit * matches / max(len(answer), len(completion))


def _check_partial_credit(partial_credit: float) -> None:
    if not 0.0 <= partial_credit <= 1.0:
        raise ValueError(f"partial_credit must be in [0, 1], got {partial_credit}")


def _check_digit_range(min_digits: int, max_digits: int) -> None:
    if not 1 <= min_digits <= max_digits:
        raise ValueError(
            f"need 1 <= min_digits <= max_digits, got min_digits={min_digits}, "
            f"max_digits={max_digits}"
        )


class ReverseTask:
    """Reverse a digit string: prompt ``"4821>"`` → answer ``"1284"``.

    Lengths are uniform in ``[min_digits, max_digits]``; digits are uniform (leading zeros
    allowed, since the answer is a string, not a number).
    """

    name: ClassVar[str] = "reverse"
    separator: ClassVar[str] = ">"

    def __init__(self, min_digits: int = 3, max_digits: int = 6, partial_credit: float = 0.0):
        _check_digit_range(min_digits, max_digits)
        _check_partial_credit(partial_credit)
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.partial_credit = partial_credit
        # The answer has at most max_digits characters; +1 for EOS, +1 slack so a model that
        # overshoots by one character is still cut by its own EOS rather than by the budget.
        self.max_new_tokens = max_digits + 2

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` digit strings drawn with ``rng``."""
        problems: list[Problem] = []
        for _ in range(n):
            length = rng.randint(self.min_digits, self.max_digits)
            digits = "".join(str(rng.randrange(10)) for _ in range(length))
            problems.append(
                Problem(
                    prompt_id=f"reverse:{digits}",
                    prompt=f"{digits}{self.separator}",
                    answer=digits[::-1],
                )
            )
        return problems

    def reward(self, problem: Problem, completion: str) -> float:
        """Exact match after stripping whitespace, else optional partial credit."""
        return exact_match_reward(problem.answer, completion, self.partial_credit)

    def demonstration(self, problem: Problem, rng: random.Random | None = None) -> str:
        """The reversed digits."""
        return problem.answer

    def __repr__(self) -> str:
        return (
            f"ReverseTask(min_digits={self.min_digits}, max_digits={self.max_digits}, "
            f"partial_credit={self.partial_credit})"
        )


class AdditionTask:
    """Add two non-negative integers: prompt ``"123+45="`` → answer ``"168"``.

    Each operand first draws its digit count uniformly in ``[min_digits, max_digits]``, then a
    value uniformly among numbers with exactly that many digits (``0..9`` for one digit), so
    short operands are as common as long ones.
    """

    name: ClassVar[str] = "addition"

    def __init__(self, min_digits: int = 1, max_digits: int = 3, partial_credit: float = 0.0):
        _check_digit_range(min_digits, max_digits)
        _check_partial_credit(partial_credit)
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.partial_credit = partial_credit
        # The sum has at most max_digits + 1 digits; +1 for EOS, +1 slack.
        self.max_new_tokens = max_digits + 3

    def _operand(self, rng: random.Random) -> int:
        num_digits = rng.randint(self.min_digits, self.max_digits)
        low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
        return rng.randint(low, 10**num_digits - 1)

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` additions drawn with ``rng``."""
        problems: list[Problem] = []
        for _ in range(n):
            a = self._operand(rng)
            b = self._operand(rng)
            problems.append(
                Problem(prompt_id=f"add:{a}+{b}", prompt=f"{a}+{b}=", answer=str(a + b))
            )
        return problems

    def reward(self, problem: Problem, completion: str) -> float:
        """Exact match after stripping whitespace, else optional partial credit."""
        return exact_match_reward(problem.answer, completion, self.partial_credit)

    def demonstration(self, problem: Problem, rng: random.Random | None = None) -> str:
        """The decimal sum."""
        return problem.answer

    def __repr__(self) -> str:
        return (
            f"AdditionTask(min_digits={self.min_digits}, max_digits={self.max_digits}, "
            f"partial_credit={self.partial_credit})"
        )


class ScratchpadTask:
    """Multi-digit addition with a worked, column-by-column scratchpad: a long answer whose
    wording varies between samples while only the final number is checked.

    Prompt ``"4821+367="``; one worked completion (a demonstration, one of many)::

        1+7=8 6+2=8 8+3=11 c1 4+0+1=5 c0 # 5188

    Columns go from the least significant digit up; each writes its two digits (a missing digit
    as ``0``), the carry in as ``+1``, the column sum, and the carry out. The wording of every
    column is free: operand order, where the carry in goes (``1+4+0`` or ``4+0+1``), and how a
    carry out is written (``c1`` or ``carry 1``; a zero carry as ``c0``, ``carry 0`` or
    nothing). Demonstrations draw these choices at random, so a warm-started policy samples
    different scratchpads for one prompt, as a language model words its reasoning differently
    from sample to sample. The reward reads only the number after the last ``#``: exact match
    (optional partial credit on it), so any scratchpad, or none, can earn it.

    Operands draw their digit count uniformly in ``[min_digits, max_digits]``, then a value with
    exactly that many digits. With the default 4 to 6 digits a demonstration is 60 to 110
    characters (about 80 on average, measured in the tests).
    """

    name: ClassVar[str] = "scratchpad"
    marker: ClassVar[str] = "#"

    def __init__(self, min_digits: int = 4, max_digits: int = 6, partial_credit: float = 0.0):
        _check_digit_range(min_digits, max_digits)
        _check_partial_credit(partial_credit)
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.partial_credit = partial_credit
        # Longest column "9+9+1=19 carry 1" + a space is 17 characters; then "# " and a sum of
        # max_digits + 1 digits, EOS, and slack so an overlong sample ends by its own EOS.
        self.max_new_tokens = 17 * max_digits + 2 + (max_digits + 1) + 1 + 8

    def _operand(self, rng: random.Random) -> int:
        num_digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randint(10 ** (num_digits - 1) if num_digits > 1 else 0, 10**num_digits - 1)

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` additions drawn with ``rng``."""
        problems: list[Problem] = []
        for _ in range(n):
            a, b = self._operand(rng), self._operand(rng)
            problems.append(
                Problem(prompt_id=f"scratchpad:{a}+{b}", prompt=f"{a}+{b}=", answer=str(a + b))
            )
        return problems

    def final_answer(self, completion: str) -> str:
        """The text after the last ``#`` (whitespace stripped); empty without a marker."""
        _, marker, answer = completion.rpartition(self.marker)
        return answer.strip() if marker else ""

    def reward(self, problem: Problem, completion: str) -> float:
        """Exact match of the final answer (after the last ``#``), else optional partial credit."""
        return exact_match_reward(
            problem.answer, self.final_answer(completion), self.partial_credit
        )

    def demonstration(self, problem: Problem, rng: random.Random | None = None) -> str:
        """A correct worked completion; ``rng`` draws its wording (None: the canonical one)."""
        a_text, b_text = problem.prompt.removesuffix("=").split("+")
        width = max(len(a_text), len(b_text))
        a_digits, b_digits = a_text.zfill(width)[::-1], b_text.zfill(width)[::-1]
        columns, carry = [], 0
        for x, y in zip(a_digits, b_digits, strict=True):
            total = int(x) + int(y) + carry
            operands = [x, y] if rng is None or rng.random() < 0.5 else [y, x]
            if carry:
                operands.insert(len(operands) if rng is None or rng.random() < 0.5 else 0, "1")
            carry_out = total // 10
            if carry_out:
                note = " c1" if rng is None or rng.random() < 0.5 else " carry 1"
            else:
                note = "" if rng is None else rng.choice(("", " c0", " carry 0"))
            columns.append(f"{'+'.join(operands)}={total}{note}")
            carry = carry_out
        return " ".join(columns) + f" {self.marker} {problem.answer}"

    def __repr__(self) -> str:
        return (
            f"ScratchpadTask(min_digits={self.min_digits}, max_digits={self.max_digits}, "
            f"partial_credit={self.partial_credit})"
        )


# ---------------------------------------------------------------------------------------------
# Numeric answers (data set task).
# ---------------------------------------------------------------------------------------------

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
    """Prompts with numeric answers from a data set file: JSONL (one JSON object per line) or
    Parquet, with the prompt and answer read from configurable columns.

    The answer column holds a number (``42``, ``"1,000"``), or a worked solution whose final
    answer follows ``####`` (GSM8K) or is the whole of its last ``\boxed{}`` (MATH), as
    :func:`reference_answer` reads it. Every record is validated on load (blank JSONL lines are
    skipped, other keys and columns ignored); an error names the file and the line (JSONL,
    1-based) or row (Parquet, 0-based) and what is wrong. The reward is 1.0 when the number
    extracted from the completion by :func:`extract_numeric_answer` equals the answer
    numerically, else 0.0.
    """

    name: ClassVar[str] = "dataset"

    def __init__(
        self,
        path: str | Path,
        max_new_tokens: int = 256,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        format: str = "auto",
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.path = Path(path)
        self.max_new_tokens = max_new_tokens
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.format = dataset_format(self.path, format)
        self.problems: list[Problem] = load_dataset_problems(
            self.path, self.format, prompt_key, answer_key, id_prefix=self.name
        )

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` problems drawn uniformly with replacement using ``rng``."""
        return [self.problems[rng.randrange(len(self.problems))] for _ in range(n)]

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 if the completion's final number equals the answer, else 0.0."""
        return numeric_reward(problem.answer, completion)

    def demonstration(self, problem: Problem, rng: random.Random | None = None) -> str:
        """Not available: the file holds answers, not worked solutions."""
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
    """:class:`DatasetTask` under its first name, ``jsonl`` (prompt ids start with ``jsonl:``)."""

    name: ClassVar[str] = "jsonl"


def dataset_format(path: Path, format: str = "auto") -> str:
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


def load_dataset_problems(
    path: str | Path,
    format: str = "auto",
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    id_prefix: str = "dataset",
) -> list[Problem]:
    """Read and validate every record of a JSONL or Parquet data set; errors name the file and
    the line (JSONL, 1-based) or row (Parquet, 0-based)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data set file {path} does not exist")
    keys = (prompt_key, answer_key, id_prefix)
    if dataset_format(path, format) == "parquet":
        problems = _load_parquet_problems(path, *keys)
    else:
        problems = _load_jsonl_problems(path, *keys)
    if not problems:
        raise ValueError(f"data set file {path} holds no problems")
    return problems


def _load_jsonl_problems(
    path: Path, prompt_key: str, answer_key: str, id_prefix: str
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
            problems.append(_problem_from_record(record, where, prompt_key, answer_key, id_prefix))
    return problems


def _load_parquet_problems(
    path: Path, prompt_key: str, answer_key: str, id_prefix: str
) -> list[Problem]:
    # Imported here: only Parquet data sets need it.
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as err:  # pyarrow raises ArrowInvalid/OSError for a file that is not Parquet
        raise ValueError(f"{path}: not a readable Parquet file ({err})") from err
    columns = []
    for key in (prompt_key, answer_key):
        column = key.split(".", 1)[0]
        if column not in schema.names:
            raise ValueError(
                f"{path}: no column {column!r} (for {key!r}); the file's columns are "
                f"{', '.join(map(repr, schema.names))}"
            )
        if column not in columns:
            columns.append(column)
    rows = pq.read_table(path, columns=columns).to_pylist()
    return [
        _problem_from_record(row, f"{path}: row {index}", prompt_key, answer_key, id_prefix)
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
    record: dict[str, Any], where: str, prompt_key: str, answer_key: str, id_prefix: str
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
    # The reward is numeric, so an answer that is not a number could never be matched.
    answer = reference_answer(str(raw_answer))
    if answer is None:
        shown = raw_answer if len(str(raw_answer)) <= 80 else f"{str(raw_answer)[:77]}..."
        raise ValueError(
            f"{where}: {answer_key!r} {shown!r} has no number (expected a number, or a solution "
            "ending in '#### N' or '\\boxed{N}')"
        )
    digest = hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]
    return Problem(prompt_id=f"{id_prefix}:{digest}", prompt=prompt, answer=answer)


# ---------------------------------------------------------------------------------------------
# Registry.
# ---------------------------------------------------------------------------------------------

TASKS: dict[str, type] = {
    ReverseTask.name: ReverseTask,
    AdditionTask.name: AdditionTask,
    ScratchpadTask.name: ScratchpadTask,
    DatasetTask.name: DatasetTask,
    JsonlTask.name: JsonlTask,
}


def make_task(name: str, **kwargs: Any) -> Task:
    """Build the task called ``name`` (``reverse``, ``addition``, ``scratchpad``, ``dataset``,
    ``jsonl``)."""
    if name == "word_problems":  # its module builds on this one's Problem and rewards
        from common.word_problems import WordProblemsTask

        task_cls: Any = WordProblemsTask
    else:
        task_cls = TASKS.get(name)
    if task_cls is None:
        known = sorted([*TASKS, "word_problems"])
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(known)}")
    signature = inspect.signature(task_cls)
    try:
        signature.bind(**kwargs)
    except TypeError as err:
        raise TypeError(f"task {name!r} accepts {signature}: {err}") from err
    return task_cls(**kwargs)


class PromptPool:
    """A fixed data set of ``size`` problems drawn once from ``task`` (with ``seed``) and sampled
    from over and over, as an RL run iterates over its training set for several epochs.

    Prompts then recur, which is what history drafting feeds on: earlier completions of the same
    prompt are drafts for the next ones.
    """

    def __init__(self, task: Task, size: int, seed: int = 0) -> None:
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        self.task = task
        self.name = task.name
        self.max_new_tokens = task.max_new_tokens
        self.problems = task.sample(random.Random(seed), size)

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [rng.choice(self.problems) for _ in range(n)]

    def reward(self, problem: Problem, completion: str) -> float:
        return self.task.reward(problem, completion)

    def demonstration(self, problem: Problem, rng: random.Random | None = None) -> str:
        return self.task.demonstration(problem, rng)

    def __repr__(self) -> str:
        return f"PromptPool({self.task!r}, size={len(self.problems)})"


def task_from_config(cfg: TaskConfig) -> Task:
    """The task a :class:`~common.config.TaskConfig` describes."""
    if cfg.is_dataset:
        return make_task(
            cfg.name,
            path=cfg.path,
            prompt_key=cfg.prompt_key,
            answer_key=cfg.answer_key,
            format=cfg.format,
            **({"max_new_tokens": cfg.max_new_tokens} if cfg.max_new_tokens else {}),
        )
    if cfg.name == "word_problems":
        task = make_task(cfg.name, min_steps=cfg.min_steps, max_steps=cfg.max_steps)
        if cfg.max_new_tokens:
            task.max_new_tokens = cfg.max_new_tokens
        return PromptPool(task, cfg.pool_size, cfg.pool_seed) if cfg.pool_size else task
    task = make_task(
        cfg.name,
        min_digits=cfg.min_digits,
        max_digits=cfg.max_digits,
        partial_credit=cfg.partial_credit,
    )
    if cfg.max_new_tokens:
        task.max_new_tokens = cfg.max_new_tokens
    return PromptPool(task, cfg.pool_size, cfg.pool_seed) if cfg.pool_size else task

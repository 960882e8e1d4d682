"""Prompt sources and exact, verifiable reward functions (the :class:`Task` protocol).

Built-in tasks (:class:`ReverseTask`, :class:`AdditionTask`, :class:`ScratchpadTask`) only use
characters of :data:`~common.tokenizer.BUILTIN_ALPHABET`, so a
:class:`~common.tokenizer.CharTokenizer` over it can encode every prompt and answer. Data set
tasks (:mod:`common.dataset_task`) and word problems (:mod:`common.word_problems`) live in their
own modules; :func:`make_task` finds them all by name.
"""

from __future__ import annotations

import importlib
import inspect
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from common.config.run import TaskConfig


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer."""

    prompt_id: str
    """Stable id: the same problem always gets the same id (used to group completions)."""
    prompt: str
    """Text fed to the model, e.g. ``"123+45="``."""
    answer: str
    """Reference answer, e.g. ``"168"``."""
    row: Mapping[str, Any] | None = field(default=None, compare=False, hash=False, repr=False)
    """A data set's whole row (every column), which a user's reward function receives; None for
    generated problems."""


@runtime_checkable
class Task(Protocol):
    """A prompt source with an exact reward."""

    name: str
    """Short name, as given to :func:`make_task`."""
    max_new_tokens: int
    """Generation budget for one completion of this task (room for the answer and EOS)."""

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` problems drawn with ``rng`` (deterministic given its state and the task's: a
        data set goes through its problems by epochs)."""
        ...

    def reward(self, problem: Problem, completion: str) -> float:
        """Score of ``completion`` (decoded text before EOS) for ``problem``, in ``[0, 1]``."""
        ...

    def demonstration(self, problem: Problem, rng: random.Random | None = None) -> str:
        """An ideal completion (for a supervised warm start); may raise NotImplementedError.
        Tasks whose solutions can be written several ways draw the way with ``rng`` (None: one
        canonical way)."""
        ...


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


class _DigitTask:
    """What the digit tasks share: a digit-count range, optional partial credit, an exact-match
    reward on the whole completion and the answer itself as the demonstration."""

    name: ClassVar[str]

    def __init__(self, min_digits: int, max_digits: int, partial_credit: float) -> None:
        if not 1 <= min_digits <= max_digits:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits, got min_digits={min_digits}, "
                f"max_digits={max_digits}"
            )
        if not 0.0 <= partial_credit <= 1.0:
            raise ValueError(f"partial_credit must be in [0, 1], got {partial_credit}")
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.partial_credit = partial_credit

    def _operand(self, rng: random.Random) -> int:
        """A digit count uniform in the range, then a value with exactly that many digits."""
        num_digits = rng.randint(self.min_digits, self.max_digits)
        low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
        return rng.randint(low, 10**num_digits - 1)

    def _additions(self, rng: random.Random, n: int, id_prefix: str) -> list[Problem]:
        """``n`` problems ``a+b=`` with answer ``a + b``, both operands from :meth:`_operand`."""
        problems: list[Problem] = []
        for _ in range(n):
            a, b = self._operand(rng), self._operand(rng)
            problems.append(
                Problem(prompt_id=f"{id_prefix}:{a}+{b}", prompt=f"{a}+{b}=", answer=str(a + b))
            )
        return problems

    def reward(self, problem: Problem, completion: str) -> float:
        return exact_match_reward(problem.answer, completion, self.partial_credit)

    def demonstration(self, problem: Problem, rng: random.Random | None = None) -> str:
        return problem.answer

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(min_digits={self.min_digits}, max_digits={self.max_digits}, "
            f"partial_credit={self.partial_credit})"
        )


class ReverseTask(_DigitTask):
    """Reverse a digit string: prompt ``"4821>"`` → answer ``"1284"``.

    Lengths are uniform in ``[min_digits, max_digits]``; digits are uniform (leading zeros
    allowed, since the answer is a string, not a number).
    """

    name: ClassVar[str] = "reverse"
    separator: ClassVar[str] = ">"

    def __init__(self, min_digits: int = 3, max_digits: int = 6, partial_credit: float = 0.0):
        super().__init__(min_digits, max_digits, partial_credit)
        # The answer has at most max_digits characters; +1 for EOS, +1 slack so a model that
        # overshoots by one character is still cut by its own EOS rather than by the budget.
        self.max_new_tokens = max_digits + 2

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
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


class AdditionTask(_DigitTask):
    """Add two non-negative integers: prompt ``"123+45="`` → answer ``"168"``.

    Each operand first draws its digit count uniformly in ``[min_digits, max_digits]``, then a
    value uniformly among numbers with exactly that many digits (``0..9`` for one digit), so
    short operands are as common as long ones.
    """

    name: ClassVar[str] = "addition"

    def __init__(self, min_digits: int = 1, max_digits: int = 3, partial_credit: float = 0.0):
        super().__init__(min_digits, max_digits, partial_credit)
        # The sum has at most max_digits + 1 digits; +1 for EOS, +1 slack.
        self.max_new_tokens = max_digits + 3

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return self._additions(rng, n, "add")


class ScratchpadTask(_DigitTask):
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

    Operands are drawn as :class:`AdditionTask`'s. With the default 4 to 6 digits a
    demonstration is 60 to 110 characters (about 80 on average).
    """

    name: ClassVar[str] = "scratchpad"
    marker: ClassVar[str] = "#"

    def __init__(self, min_digits: int = 4, max_digits: int = 6, partial_credit: float = 0.0):
        super().__init__(min_digits, max_digits, partial_credit)
        # Longest column "9+9+1=19 carry 1" + a space is 17 characters; then "# " and a sum of
        # max_digits + 1 digits, EOS, and slack so an overlong sample ends by its own EOS.
        self.max_new_tokens = 17 * max_digits + 2 + (max_digits + 1) + 1 + 8

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return self._additions(rng, n, "scratchpad")

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


TASKS: dict[str, type] = {
    ReverseTask.name: ReverseTask,
    AdditionTask.name: AdditionTask,
    ScratchpadTask.name: ScratchpadTask,
}
# Tasks whose modules build on this one (Problem, rewards): imported when first asked for.
_TASKS_ELSEWHERE: dict[str, tuple[str, str]] = {
    "dataset": ("common.dataset_task", "DatasetTask"),
    "jsonl": ("common.dataset_task", "JsonlTask"),
    "word_problems": ("common.word_problems", "WordProblemsTask"),
    "lookup": ("common.lookup", "LookupTask"),
    "guess_number": ("common.guess_number", "GuessNumberTask"),
}


def make_task(name: str, **kwargs: Any) -> Task:
    """Build the task called ``name`` (``reverse``, ``addition``, ``scratchpad``, ``dataset``,
    ``jsonl``, ``word_problems``, ``lookup``, ``guess_number``)."""
    task_cls: Any = TASKS.get(name)
    if name in _TASKS_ELSEWHERE:
        module, cls_name = _TASKS_ELSEWHERE[name]
        task_cls = getattr(importlib.import_module(module), cls_name)
    if task_cls is None:
        known = sorted([*TASKS, *_TASKS_ELSEWHERE])
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
    """The task a :class:`~common.config.run.TaskConfig` describes."""
    if cfg.is_dataset:
        return make_task(
            cfg.name,
            path=cfg.path,
            prompt_key=cfg.prompt_key,
            answer_key=cfg.answer_key,
            format=cfg.format,
            numeric_answers=not cfg.reward,
            split=cfg.split,
            eval_path=cfg.eval_path,
            eval_split=cfg.eval_split,
            eval_fraction=cfg.eval_fraction,
            **({"max_new_tokens": cfg.max_new_tokens} if cfg.max_new_tokens else {}),
        )
    if cfg.name == "word_problems":
        task = make_task(cfg.name, min_steps=cfg.min_steps, max_steps=cfg.max_steps)
    else:
        task = make_task(
            cfg.name,
            min_digits=cfg.min_digits,
            max_digits=cfg.max_digits,
            partial_credit=cfg.partial_credit,
        )
    if cfg.max_new_tokens:
        task.max_new_tokens = cfg.max_new_tokens
    return PromptPool(task, cfg.pool_size, cfg.pool_seed) if cfg.pool_size else task


def held_out_problems(task: Task, n: int, seed: int) -> list[Problem]:
    """Problems to evaluate on that training never draws: a data set's held-out ones (the first
    ``n``; 0: all), else ``n`` problems the task generates with ``seed``, leaving out a fixed
    training pool's prompts. Raises ValueError if there are none."""
    held = getattr(task, "eval_problems", None)
    inner = task.task if isinstance(task, PromptPool) else task
    if held is None:
        held = getattr(inner, "eval_problems", None)
    if held is not None:
        if not held:
            raise ValueError(
                f"{task!r} holds no held-out problems: set task.eval_fraction, task.eval_path or "
                "task.eval_split"
            )
        return list(held[:n] if n else held)
    training = {p.prompt for p in task.problems} if isinstance(task, PromptPool) else set()
    rng, problems, seen = random.Random(seed), [], set()
    want = n or 64
    for _ in range(100):
        for problem in inner.sample(rng, want):
            if problem.prompt not in training and problem.prompt not in seen:
                seen.add(problem.prompt)
                problems.append(problem)
        if len(problems) >= want:
            break
    if not problems:
        raise ValueError(f"{task!r}: no problem outside the training pool to evaluate on")
    return problems[:want]

"""Tasks: exact rewards (table-driven), numeric answer extraction, deterministic sampling,
JSONL loading and validation, the task registry."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from common.dataset_task import JsonlTask, extract_numeric_answer, numeric_answers_equal
from common.tasks import (
    AdditionTask,
    Problem,
    ReverseTask,
    ScratchpadTask,
    Task,
    exact_match_reward,
    make_task,
)
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer

# ---------------------------------------------------------------------------------------------
# Built-in rewards
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "completion", "partial_credit", "expected"),
    [
        # exact
        ("168", "168", 0.0, 1.0),
        ("168", "168", 0.5, 1.0),
        # surrounding whitespace is ignored, inner whitespace is not
        ("168", "  168\n", 0.0, 1.0),
        ("168", "1 68", 0.0, 0.0),
        # wrong, no partial credit
        ("168", "167", 0.0, 0.0),
        ("168", "", 0.0, 0.0),
        ("168", "1680", 0.0, 0.0),
        # partial credit: 2 of 3 positions match
        ("168", "167", 0.3, 0.3 * 2 / 3),
        # too long: 3 matches over max(3, 4) = 4
        ("168", "1680", 0.4, 0.4 * 3 / 4),
        # too short: 1 match over max(3, 1) = 3
        ("168", "1", 0.6, 0.6 * 1 / 3),
        # positions are compared left-aligned, so a shifted answer earns nothing
        ("168", "0168", 0.5, 0.0),
        # empty or whitespace-only completion earns nothing
        ("168", "   ", 0.5, 0.0),
        # partial credit never reaches a correct answer's reward
        ("12", "13", 1.0, 0.5),
    ],
)
def test_exact_match_reward_table(
    answer: str, completion: str, partial_credit: float, expected: float
) -> None:
    assert exact_match_reward(answer, completion, partial_credit) == pytest.approx(expected)


@pytest.mark.parametrize("task_cls", [ReverseTask, AdditionTask])
def test_builtin_reward_uses_partial_credit(task_cls: type) -> None:
    problem = Problem(prompt_id="x", prompt="x", answer="1234")
    assert task_cls().reward(problem, "1234") == 1.0
    assert task_cls().reward(problem, "1235") == 0.0
    assert task_cls(partial_credit=0.2).reward(problem, "1235") == pytest.approx(0.2 * 3 / 4)


@pytest.mark.parametrize("task_cls", [ReverseTask, AdditionTask, ScratchpadTask])
@pytest.mark.parametrize("partial_credit", [-0.1, 1.5])
def test_builtin_rejects_bad_partial_credit(task_cls: type, partial_credit: float) -> None:
    with pytest.raises(ValueError, match="partial_credit"):
        task_cls(partial_credit=partial_credit)


@pytest.mark.parametrize("task_cls", [ReverseTask, AdditionTask, ScratchpadTask])
def test_builtin_rejects_bad_digit_range(task_cls: type) -> None:
    with pytest.raises(ValueError, match="min_digits=4, max_digits=2"):
        task_cls(min_digits=4, max_digits=2)
    with pytest.raises(ValueError, match="min_digits=0"):
        task_cls(min_digits=0, max_digits=2)


# ---------------------------------------------------------------------------------------------
# Built-in sampling
# ---------------------------------------------------------------------------------------------


def test_reverse_problem_shape() -> None:
    task = ReverseTask(min_digits=3, max_digits=6)
    for problem in task.sample(random.Random(0), 200):
        digits, separator, rest = problem.prompt.partition(">")
        assert separator == ">" and rest == ""
        assert digits.isdigit() and 3 <= len(digits) <= 6
        assert problem.answer == digits[::-1]
        assert problem.prompt_id == f"reverse:{digits}"
        assert task.demonstration(problem) == problem.answer
        assert task.reward(problem, task.demonstration(problem)) == 1.0
        assert len(problem.answer) + 1 <= task.max_new_tokens


def test_reverse_example() -> None:
    problem = Problem(prompt_id="reverse:4821", prompt="4821>", answer="1284")
    assert ReverseTask().reward(problem, "1284") == 1.0


def test_addition_problem_shape() -> None:
    task = AdditionTask(min_digits=1, max_digits=3)
    lengths: set[int] = set()
    for problem in task.sample(random.Random(0), 500):
        assert problem.prompt.endswith("=")
        a_text, b_text = problem.prompt[:-1].split("+")
        a, b = int(a_text), int(b_text)
        # No leading zeros: the operand text is the canonical decimal form.
        assert a_text == str(a) and b_text == str(b)
        lengths.update((len(a_text), len(b_text)))
        assert problem.answer == str(a + b)
        assert problem.prompt_id == f"add:{a}+{b}"
        assert task.reward(problem, task.demonstration(problem)) == 1.0
        assert len(problem.answer) + 1 <= task.max_new_tokens
    assert lengths == {1, 2, 3}


@pytest.mark.parametrize(
    "task", [ReverseTask(), AdditionTask(), AdditionTask(max_digits=6), ScratchpadTask()]
)
def test_builtin_sampling_is_deterministic_given_rng(task: Task) -> None:
    first = task.sample(random.Random(1234), 50)
    second = task.sample(random.Random(1234), 50)
    other = task.sample(random.Random(4321), 50)
    assert first == second
    assert first != other


@pytest.mark.parametrize("task", [ReverseTask(1, 8), AdditionTask(1, 5), ScratchpadTask(1, 7)])
def test_builtin_text_is_in_builtin_alphabet(task: Task) -> None:
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    rng = random.Random(8)
    for problem in task.sample(random.Random(7), 300):
        # encode raises on any character outside the alphabet.
        tokenizer.encode(problem.prompt)
        tokenizer.encode(task.demonstration(problem))
        tokenizer.encode(task.demonstration(problem, rng))


def test_same_problem_same_prompt_id() -> None:
    task = AdditionTask(min_digits=1, max_digits=1)
    by_id: dict[str, Problem] = {}
    for problem in task.sample(random.Random(3), 1000):
        assert by_id.setdefault(problem.prompt_id, problem) == problem


@pytest.mark.parametrize("task", [ReverseTask(), AdditionTask(), ScratchpadTask()])
def test_builtin_tasks_satisfy_protocol(task: Task) -> None:
    assert isinstance(task, Task)


# ---------------------------------------------------------------------------------------------
# Scratchpad addition: long worked answers, reward on the final number only
# ---------------------------------------------------------------------------------------------


def test_scratchpad_canonical_demonstration() -> None:
    task = ScratchpadTask()
    problem = Problem(prompt_id="scratchpad:4821+367", prompt="4821+367=", answer="5188")
    assert task.demonstration(problem) == "1+7=8 2+6=8 8+3=11 c1 4+0+1=5 # 5188"
    carry_out = Problem(prompt_id="scratchpad:95+17", prompt="95+17=", answer="112")
    assert task.demonstration(carry_out) == "5+7=12 c1 9+1+1=11 c1 # 112"


def _check_trace(problem: Problem, trace: str) -> None:
    """Re-derive every column of a worked answer: digits, carries and sums must be right."""
    a_text, b_text = problem.prompt[:-1].split("+")
    width = max(len(a_text), len(b_text))
    a, b = a_text.zfill(width)[::-1], b_text.zfill(width)[::-1]
    steps, _, final = trace.partition(" # ")
    assert final == problem.answer
    tokens = steps.split(" ")
    carry, column = 0, 0
    while tokens:
        sum_text = tokens.pop(0)
        operands, total = sum_text.split("=")
        parts = operands.split("+")
        expected = sorted([a[column], b[column]] + (["1"] if carry else []))
        assert sorted(parts) == expected, (sum_text, expected)
        assert int(total) == int(a[column]) + int(b[column]) + carry
        note = []
        while tokens and not tokens[0][0].isdigit():
            note.append(tokens.pop(0))
        if tokens and tokens[0] in ("0", "1") and note == ["carry"]:
            note.append(tokens.pop(0))
        carry = int(total) // 10
        assert " ".join(note) in ({"", "c0", "carry 0"} if carry == 0 else {"c1", "carry 1"})
        column += 1
    assert column == width


def test_scratchpad_varied_demonstrations_are_correct_and_differ() -> None:
    task = ScratchpadTask()
    rng = random.Random(0)
    lengths = []
    for problem in task.sample(random.Random(1), 300):
        traces = {task.demonstration(problem, rng) for _ in range(8)}
        # The wording varies between samples of one prompt, as the policy's samples do.
        assert len(traces) > 1
        for trace in traces:
            _check_trace(problem, trace)
            assert task.reward(problem, trace) == 1.0
            assert len(trace) + 1 <= task.max_new_tokens
            lengths.append(len(trace))
    # Long answers: the task exists for completions of at least 64 tokens on average.
    assert sum(lengths) / len(lengths) >= 64
    assert max(lengths) + 1 <= task.max_new_tokens


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("1+7=8 2+6=8 8+3=11 c1 4+0+1=5 # 5188", 1.0),
        ("# 5188", 1.0),  # the scratchpad is free: only the final answer counts
        ("9+9=99 # 5188  ", 1.0),  # even a wrong scratchpad
        ("# 1 # 5188", 1.0),  # the last marker wins
        ("# 5188 # 1", 0.0),
        ("1+7=8 2+6=8 8+3=11 c1 4+0+1=5 # 5189", 0.0),
        ("5188", 0.0),  # no marker, no answer
        ("1+7=8 # ", 0.0),
        ("", 0.0),
    ],
)
def test_scratchpad_reward_reads_the_final_answer(completion: str, reward: float) -> None:
    problem = Problem(prompt_id="scratchpad:4821+367", prompt="4821+367=", answer="5188")
    assert ScratchpadTask().reward(problem, completion) == reward


def test_scratchpad_partial_credit_is_on_the_final_answer() -> None:
    problem = Problem(prompt_id="scratchpad:4821+367", prompt="4821+367=", answer="5188")
    task = ScratchpadTask(partial_credit=0.5)
    assert task.reward(problem, "8+1=9 # 5189") == pytest.approx(0.5 * 3 / 4)


def test_scratchpad_problem_shape() -> None:
    task = ScratchpadTask(min_digits=4, max_digits=6)
    lengths: set[int] = set()
    for problem in task.sample(random.Random(0), 500):
        a_text, b_text = problem.prompt[:-1].split("+")
        assert a_text == str(int(a_text)) and b_text == str(int(b_text))
        lengths.update((len(a_text), len(b_text)))
        assert problem.answer == str(int(a_text) + int(b_text))
        assert problem.prompt_id == f"scratchpad:{a_text}+{b_text}"
    assert lengths == {4, 5, 6}
    assert isinstance(make_task("scratchpad"), ScratchpadTask)


# ---------------------------------------------------------------------------------------------
# Numeric answer extraction
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # \boxed wins over everything else, the last box wins
        ("so x = 3 and the answer is \\boxed{42}. Check: 7", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("#### 5 but \\boxed{6}", "6"),
        ("\\boxed{\\frac{1}{2} = 0.5}", "0.5"),
        ("\\boxed{1,000}", "1000"),
        ("\\boxed{x}", None),
        # an unclosed (truncated) box falls back to an earlier complete one
        ("\\boxed{7} and \\boxed{8", "7"),
        # GSM8K: first number after the last ####
        ("Natalia sold 48 clips... #### 72", "72"),
        ("#### 1 then more #### 2 and 3", "2"),
        ("#### $1,234.50 total", "1234.50"),
        ("#### none", None),
        # else the last number in the text
        ("She has 3 apples and buys 4 more, so 7.", "7"),
        ("The total is 1,000 dollars", "1000"),
        ("It costs 12,345,678.9 in total", "12345678.9"),
        ("3.0", "3.0"),
        ("Half is .5", ".5"),
        # negatives; a minus after a digit is subtraction, not a sign
        ("the temperature is -5", "-5"),
        ("10-3=7", "7"),
        ("result: 10-3", "3"),
        ("\\boxed{-12}", "-12"),
        # list commas are not thousands separators
        ("1, 2, 3", "3"),
        ("values 1,23", "23"),
        # nothing numeric
        ("no numbers here", None),
        ("", None),
    ],
)
def test_extract_numeric_answer(text: str, expected: str | None) -> None:
    assert extract_numeric_answer(text) == expected


@pytest.mark.parametrize(
    ("answer", "predicted", "equal"),
    [
        ("1000", "1000", True),
        ("1,000", "1000", True),
        ("1000", "1,000", True),
        ("3", "3.0", True),
        ("3.50", "3.5", True),
        ("-2", "-2.00", True),
        ("3", "4", False),
        ("0.1", "0.10000001", False),
        ("3", None, False),
    ],
)
def test_numeric_answers_equal(answer: str, predicted: str | None, equal: bool) -> None:
    assert numeric_answers_equal(answer, predicted) is equal


# ---------------------------------------------------------------------------------------------
# JSONL task
# ---------------------------------------------------------------------------------------------


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def jsonl_path(tmp_path: Path) -> Path:
    records = [
        {"prompt": "What is 2+2?", "answer": "4"},
        {"prompt": "How many in a thousand?", "answer": 1000, "source": "extra keys are ignored"},
        {"prompt": "Half of 7?", "answer": 3.5},
        {"prompt": "Big number?", "answer": "1,000,000"},
    ]
    lines = [json.dumps(r) for r in records]
    lines.insert(2, "   ")  # blank lines are skipped
    return _write_jsonl(tmp_path / "problems.jsonl", lines)


def test_jsonl_loads_problems(jsonl_path: Path) -> None:
    task = JsonlTask(jsonl_path)
    assert [p.prompt for p in task.problems] == [
        "What is 2+2?",
        "How many in a thousand?",
        "Half of 7?",
        "Big number?",
    ]
    assert [p.answer for p in task.problems] == ["4", "1000", "3.5", "1,000,000"]
    assert len({p.prompt_id for p in task.problems}) == 4
    assert all(p.prompt_id.startswith("jsonl:") for p in task.problems)
    assert isinstance(task, Task)


def test_jsonl_prompt_ids_are_stable_across_files(jsonl_path: Path, tmp_path: Path) -> None:
    reordered = jsonl_path.read_text().splitlines()[::-1]
    other = JsonlTask(_write_jsonl(tmp_path / "other.jsonl", reordered))
    ids = {p.prompt: p.prompt_id for p in JsonlTask(jsonl_path).problems}
    assert {p.prompt: p.prompt_id for p in other.problems} == ids


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("2+2 is \\boxed{4}", 1.0),
        ("#### 4", 1.0),
        ("I think it is 4.0", 1.0),
        ("The answer is 5", 0.0),
        ("\\boxed{5} though 4", 0.0),
        ("no idea", 0.0),
    ],
)
def test_jsonl_reward(jsonl_path: Path, completion: str, reward: float) -> None:
    task = JsonlTask(jsonl_path)
    assert task.reward(task.problems[0], completion) == reward


@pytest.mark.parametrize(
    ("index", "completion"),
    [(1, "#### 1,000"), (2, "3.50"), (3, "\\boxed{1000000}")],
)
def test_jsonl_reward_numeric_forms(jsonl_path: Path, index: int, completion: str) -> None:
    task = JsonlTask(jsonl_path)
    assert task.reward(task.problems[index], completion) == 1.0


def test_jsonl_sampling_is_deterministic_and_goes_by_epochs(jsonl_path: Path) -> None:
    task = JsonlTask(jsonl_path)
    first = task.sample(random.Random(5), 30)
    assert first == JsonlTask(jsonl_path).sample(random.Random(5), 30)
    n = len(task.problems)
    # Without replacement: each epoch of n draws holds every problem once.
    for epoch in range(30 // n):
        ids = [p.prompt_id for p in first[epoch * n : (epoch + 1) * n]]
        assert sorted(ids) == sorted(p.prompt_id for p in task.problems), epoch
    assert task.epoch == -(-30 // n)


def test_jsonl_has_no_demonstration(jsonl_path: Path) -> None:
    task = JsonlTask(jsonl_path)
    with pytest.raises(NotImplementedError, match="no demonstrations"):
        task.demonstration(task.problems[0])


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"answer": "3"}', "missing 'prompt'"),
        ('{"prompt": "", "answer": "3"}', "'prompt' must be a non-empty string"),
        ('{"prompt": 3, "answer": "3"}', "'prompt' must be a non-empty string"),
        ('{"prompt": "q"}', "missing 'answer'"),
        ('{"prompt": "q", "answer": null}', "'answer' must be a string or a number"),
        ('{"prompt": "q", "answer": true}', "'answer' must be a string or a number"),
        ('{"prompt": "q", "answer": NaN}', "'answer' must be finite"),
        ('{"prompt": "q", "answer": "seven"}', "'seven' has no number"),
    ],
)
def test_jsonl_bad_line_error_quotes_file_and_line(
    tmp_path: Path, bad_line: str, message: str
) -> None:
    path = _write_jsonl(
        tmp_path / "bad.jsonl",
        ['{"prompt": "ok", "answer": 1}', "", bad_line, '{"prompt": "ok2", "answer": 2}'],
    )
    with pytest.raises(ValueError) as info:
        JsonlTask(path)
    assert f"{path}:3:" in str(info.value)
    assert message in str(info.value)


def test_jsonl_empty_file_is_an_error(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="holds no problems"):
        JsonlTask(path)


def test_jsonl_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        JsonlTask(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def test_make_task_builds_each_kind(jsonl_path: Path) -> None:
    reverse = make_task("reverse", min_digits=2, max_digits=4, partial_credit=0.1)
    assert isinstance(reverse, ReverseTask) and reverse.max_digits == 4
    addition = make_task("addition")
    assert isinstance(addition, AdditionTask) and addition.name == "addition"
    jsonl = make_task("jsonl", path=jsonl_path, max_new_tokens=64)
    assert isinstance(jsonl, JsonlTask) and jsonl.max_new_tokens == 64


def test_make_task_unknown_name_lists_known() -> None:
    with pytest.raises(ValueError) as info:
        make_task("multiply")
    for name in ("reverse", "addition", "jsonl", "'multiply'"):
        assert name in str(info.value)


def test_make_task_bad_kwargs_name_the_task() -> None:
    with pytest.raises(TypeError, match="task 'jsonl'.*path"):
        make_task("jsonl")
    with pytest.raises(TypeError, match="task 'reverse'"):
        make_task("reverse", digits=3)

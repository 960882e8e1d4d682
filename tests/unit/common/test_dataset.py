"""Data set tasks: JSONL and Parquet files with configurable columns, numeric answers read from
``####`` and ``\\boxed{}`` solutions, malformed records named by file and line or row, the
config options, and the launcher's preflight that reads the file before anything starts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from common.config import load_config
from common.dataset_task import DatasetTask, JsonlTask, reference_answer
from common.tasks import task_from_config
from ops.launcher import PreflightError, preflight
from testing.own_model import build_tokenizer, write_parquet

ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "solution": "3 + 4 = 7. #### 7"},
    {"question": "Half of 9?", "solution": "Half of 9 is \\boxed{4.5}."},
    {"question": "A thousand and one?", "solution": "#### 1,001"},
    {"question": "Plain?", "solution": 12},
]


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) for r in records))
    return path


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("42", "42"),
        (" 1,000 ", "1,000"),
        ("-3.5", "-3.5"),
        ("so 5 + 2 = 7 #### 7", "7"),
        ("#### 1,234", "1234"),
        ("the answer is \\boxed{12}", "12"),
        ("\\boxed{ $3.5$ }", "3.5"),
        ("\\boxed{\\frac{1}{2}}", None),  # not one number: refused, never read as 2
        ("about five", None),
        ("he has 7 apples", None),  # no marker: which number is meant is unknown
        ("####", None),
    ],
)
def test_reference_answer(raw: str, expected: str | None) -> None:
    assert reference_answer(raw) == expected


def test_parquet_with_custom_columns(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "train.parquet", [{**r, "solution": str(r["solution"])} for r in ROWS]
    )
    task = DatasetTask(path, prompt_key="question", answer_key="solution")
    assert task.format == "parquet"
    assert [p.prompt for p in task.problems] == [r["question"] for r in ROWS]
    assert [p.answer for p in task.problems] == ["7", "4.5", "1001", "12"]
    assert all(p.prompt_id.startswith("dataset:") for p in task.problems)
    first = task.problems[0]
    assert task.reward(first, "3 and 4 make \\boxed{7}") == 1.0
    assert task.reward(first, "#### 8") == 0.0
    again = DatasetTask(path, prompt_key="question", answer_key="solution")
    assert task.sample(random.Random(1), 5) == again.sample(random.Random(1), 5)


def test_jsonl_with_custom_and_nested_keys(tmp_path: Path) -> None:
    records = [{"q": r["question"], "reward_model": {"ground_truth": r["solution"]}} for r in ROWS]
    path = _jsonl(tmp_path / "train.json", [json.dumps(r) + "\n" for r in records])
    task = DatasetTask(path, prompt_key="q", answer_key="reward_model.ground_truth")
    assert task.format == "jsonl"
    assert [p.answer for p in task.problems] == ["7", "4.5", "1001", "12"]


def test_jsonl_alias_reads_parquet_too(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "t.parquet", [{"prompt": "1+1?", "answer": "2"}])
    task = JsonlTask(path)
    assert task.problems[0].prompt_id.startswith("jsonl:") and task.problems[0].answer == "2"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"question": None, "solution": "#### 3"},
            "'question' must be a non-empty string, got None",
        ),
        ({"question": "", "solution": "#### 3"}, "'question' must be a non-empty string"),
        ({"question": "q", "solution": "three"}, "'solution' 'three' has no number"),
        ({"question": "q", "solution": None}, "'solution' must be a string or a number"),
        ({"question": "q", "solution": "\\boxed{x+1}"}, "has no number"),
    ],
)
def test_parquet_malformed_row_is_named(tmp_path: Path, row: dict, message: str) -> None:
    rows = (
        [{"question": "ok", "solution": "#### 1"}] * 3
        + [row]
        + [{"question": "z", "solution": "2"}]
    )
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError) as info:
        DatasetTask(path, prompt_key="question", answer_key="solution")
    assert f"{path}: row 3: " in str(info.value)
    assert message in str(info.value)


def test_parquet_missing_column_lists_the_columns(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "t.parquet", [{"question": "q", "answer": "1"}])
    with pytest.raises(ValueError) as info:
        DatasetTask(path, prompt_key="question", answer_key="solution")
    assert str(path) in str(info.value)
    assert "no column 'solution'" in str(info.value) and "'question', 'answer'" in str(info.value)


def test_not_a_parquet_file(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    path.write_text('{"prompt": "q", "answer": 1}\n')
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        DatasetTask(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question": "q", "solution": "#### 4"', "invalid JSON"),
        ('{"solution": "#### 4"}', "missing 'question'"),
        ('{"question": "q"}', "missing 'solution'"),
        ('{"question": ["q"], "solution": "#### 4"}', "'question' must be a non-empty string"),
        ('{"question": "q", "solution": "no idea"}', "'solution' 'no idea' has no number"),
    ],
)
def test_jsonl_malformed_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    good = '{"question": "ok", "solution": "#### 1"}\n'
    path = _jsonl(tmp_path / "bad.jsonl", [good, "\n", good, line + "\n"])
    with pytest.raises(ValueError) as info:
        DatasetTask(path, prompt_key="question", answer_key="solution")
    assert f"{path}:4: " in str(info.value)
    assert message in str(info.value)


# ---------------------------------------------------------------------------------------------
# Config and task_from_config
# ---------------------------------------------------------------------------------------------


def _cfg(*overrides: str):
    return load_config(["model.path=/models/m", *overrides])


def test_config_builds_the_dataset_task(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "t.parquet", ROWS[:1])
    cfg = _cfg(
        "task=dataset",
        f"task.path={path}",
        "task.prompt_key=question",
        "task.answer_key=solution",
        "task.max_new_tokens=32",
        "task.chat_template=false",
        "task.system_prompt=Be brief.",
    )
    assert cfg.task.chat_template == "false" and cfg.task.system_prompt == "Be brief."
    task = task_from_config(cfg.task)
    assert isinstance(task, DatasetTask) and task.max_new_tokens == 32
    assert task.problems[0].answer == "7"
    assert (
        _cfg("task=dataset", f"task.path={path}", "task.chat_template=true").task.chat_template
        == "true"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["task=dataset"], "task.path"),
        (["task=dataset", "task.path=x.csv"], "task.path='x.csv': cannot tell the format"),
        (["task=dataset", "task.path=x.jsonl", "task.format=csv"], "got 'csv'"),
        (["task=dataset", "task.path=x.jsonl", "task.chat_template=maybe"], "got 'maybe'"),
        (["task=dataset", "task.path=x.jsonl", "task.prompt_key="], "task.prompt_key"),
    ],
)
def test_config_refuses_bad_dataset_options(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        _cfg(*overrides)


def test_dataset_needs_a_model_path() -> None:
    with pytest.raises(ValueError, match="task=dataset needs model.path"):
        load_config(["task=dataset", "task.path=x.jsonl"])


# ---------------------------------------------------------------------------------------------
# Preflight: the file is read and checked before any process starts
# ---------------------------------------------------------------------------------------------


def _model_dir(tmp_path: Path, chat_template: bool) -> Path:
    directory = tmp_path / ("chat" if chat_template else "plain")
    build_tokenizer(directory, chat_template=chat_template)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 400,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 512,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_preflight_names_the_malformed_record(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", ['{"prompt": "q", "answer": 1}\n', '{"prompt": "q2"}\n'])
    model = _model_dir(tmp_path, chat_template=True)
    cfg = load_config([f"model.path={model}", "task=dataset", f"task.path={path}"])
    with pytest.raises(PreflightError) as info:
        preflight(cfg, [])
    assert f"task.path='{path}'" in str(info.value) and f"{path}:2: missing 'answer'" in str(
        info.value
    )


def test_preflight_checks_the_chat_template_options(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", ['{"prompt": "q", "answer": 1}\n'])
    chat, plain = _model_dir(tmp_path, True), _model_dir(tmp_path, False)
    base = ["task=dataset", f"task.path={path}"]
    preflight(load_config([f"model.path={chat}", *base, "task.system_prompt=Be brief."]), [])
    preflight(load_config([f"model.path={plain}", *base]), [])
    with pytest.raises(PreflightError, match="task.chat_template=true: the tokenizer"):
        preflight(load_config([f"model.path={plain}", *base, "task.chat_template=true"]), [])
    with pytest.raises(PreflightError, match="task.system_prompt='Be brief.' needs"):
        preflight(load_config([f"model.path={plain}", *base, "task.system_prompt=Be brief."]), [])
    with pytest.raises(PreflightError, match="task.system_prompt='Be brief.' needs"):
        preflight(
            load_config(
                [
                    f"model.path={chat}",
                    *base,
                    "task.chat_template=false",
                    "task.system_prompt=Be brief.",
                ]
            ),
            [],
        )


def _saved_dataset_dict(tmp_path: Path) -> Path:
    import datasets

    rows = [
        {"question": r["question"], "solution": str(r["solution"]), "level": i}
        for i, r in enumerate(ROWS)
    ]
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(rows[:3]),
            "test": datasets.Dataset.from_list(rows[3:]),
        }
    ).save_to_disk(str(saved))
    return saved


def test_a_save_to_disk_directory_and_its_splits_through_datasets(tmp_path: Path) -> None:
    saved = _saved_dataset_dict(tmp_path)
    task = DatasetTask(saved, prompt_key="question", answer_key="solution", eval_split="test")
    assert task.format == "disk"
    assert [p.prompt for p in task.problems] == [r["question"] for r in ROWS[:3]]
    assert [p.prompt for p in task.eval_problems] == [ROWS[3]["question"]]
    assert task.problems[1].row == {**task.problems[1].row, "level": 1}  # the whole row
    with pytest.raises(ValueError, match="no split 'validation'"):
        DatasetTask(saved, prompt_key="question", answer_key="solution", split="validation")
    # One split's Arrow file, read as a file of datasets' own format.
    (arrow,) = (saved / "train").glob("*.arrow")
    from_file = DatasetTask(arrow, prompt_key="question", answer_key="solution")
    assert from_file.format == "arrow"
    assert [p.answer for p in from_file.problems] == [p.answer for p in task.problems]


def test_a_held_out_fraction_is_never_trained_on_and_the_same_every_time(tmp_path: Path) -> None:
    lines = [
        json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(200)
    ]
    path = _jsonl(tmp_path / "many.jsonl", lines)
    task = DatasetTask(path, eval_fraction=0.25)
    assert 30 <= len(task.eval_problems) <= 70, len(task.eval_problems)
    assert len(task.problems) + len(task.eval_problems) == 200
    held = {p.prompt for p in task.eval_problems}
    drawn = task.sample(random.Random(0), 600)  # four epochs
    assert not held & {p.prompt for p in drawn}
    assert held == {p.prompt for p in DatasetTask(path, eval_fraction=0.25).eval_problems}
    # A held-out file of its own: its prompts leave the training set too.
    eval_path = _jsonl(tmp_path / "eval.jsonl", lines[:10])
    with_file = DatasetTask(path, eval_path=eval_path)
    assert len(with_file.eval_problems) == 10 and len(with_file.problems) == 190


def test_config_takes_one_way_of_holding_out():
    from common.config import load_config

    with pytest.raises(ValueError, match="set one"):
        load_config(
            ["task=dataset", "task.path=x.jsonl", "task.eval_fraction=0.1", "task.eval_split=test"]
        )
    with pytest.raises(ValueError, match="eval_fraction"):
        load_config(["task=dataset", "task.path=x.jsonl", "task.eval_fraction=1.0"])

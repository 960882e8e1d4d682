"""A user's own model and data set through `specrl run`: the README's "Train your own model"
command run as written, on a tiny Qwen2 model and tokenizer made here with `transformers`, and a
Parquet file with custom column names; a malformed record refused before anything starts."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from common.link.protocol import DecodeLimits
from learner.checkpoint import load_pending
from ops.processes import ROOT
from testing.own_model import build_model, write_parquet

pytestmark = pytest.mark.integration

SYSTEM_PROMPT = "You are a careful math tutor."


def readme_commands() -> list[str]:
    """The `specrl` commands of the README's "Your own model and data set" section,
    continuation lines joined."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Your own model and data set\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "no bash block in the README's Your own model and data set section"
    joined = block.group(1).replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip().startswith("specrl ")]


def problems(n: int = 20) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = 1 + i % 5, 1 + i // 5
        rows.append(
            {
                "id": i,
                "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
                "solution": f"He has {a} + {b} = {a + b} apples. #### {a + b}",
            }
        )
    return rows


def shell(command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``command`` through bash, as a user types it, with this venv's `specrl` on PATH."""
    env = dict(
        os.environ,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=str(ROOT),
    )
    return subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_readme_command_trains_own_model_on_a_parquet_file_with_custom_columns(tmp_path):
    commands = readme_commands()
    assert len(commands) == 1, commands
    command = commands[0]
    for option in ("task.path=data/train.parquet", "task.prompt_key=question", "run.steps=3"):
        assert option in shlex.split(command), option
    model_dir = build_model(tmp_path / "models" / "my-model")
    rows = problems()
    write_parquet(tmp_path / "data" / "train.parquet", rows)

    done = shell(command, tmp_path, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["steps"] == 3, summary
    assert summary["groups_trained"] >= 3 * 4

    # The groups the learner holds (acked, not yet trained) carry the prompt ids the actor
    # generated from: the chat template with the system turn, exactly as transformers makes it.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    expected = {}
    for row in rows:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": row["question"]},
        ]
        ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        expected[tuple(ids)] = row
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    pending = load_pending(checkpoint, DecodeLimits(vocab_size=len(hf)))
    for group in pending:
        assert tuple(int(i) for i in group.prompt_ids) in expected, hf.decode(group.prompt_ids)


def test_a_malformed_record_is_named_before_anything_starts(tmp_path):
    model_dir = build_model(tmp_path / "model")
    rows = problems(6)
    rows[4]["solution"] = "about five apples"
    data = write_parquet(tmp_path / "bad.parquet", rows)
    command = (
        f"specrl run model.path={model_dir} task=dataset task.path={data} "
        f"task.prompt_key=question task.answer_key=solution run.dir={tmp_path / 'run'}"
    )
    done = shell(command, tmp_path, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert f"{data}: row 4: 'solution' 'about five apples' has no number" in out, out
    assert not (tmp_path / "run" / "learner.log").exists()

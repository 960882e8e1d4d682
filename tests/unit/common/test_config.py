"""Hydra structured configs: overrides compose, bad values fail at start quoting the value."""

import dataclasses

import pytest

from common import config as config_module
from common.config import SpecRLConfig, load_config
from common.entrypoint import parse
from ops.cli import main as cli_main


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


def test_entrypoint_turns_errors_into_one_line(capsys):
    with pytest.raises(SystemExit, match="invalid configuration.*max_staleness"):
        parse(["learner.max_staleness=-3"], "specrl-learner", "")
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        parse(["--steps", "3"], "specrl-learner", "")
    assert parse(["--help"], "specrl-actor", "desc") is None
    assert "learner.address" in capsys.readouterr().out


def test_cli_help_lists_main_overrides(capsys):
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    for key in ("actor.num_actors", "task=", "run.steps", "learner.max_staleness", "redis.url"):
        assert key in out


def test_every_field_has_a_docstring():
    # CleanRL-style: a docstring under every config field (checked in the source).
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(config_module))
    missing = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or node.name == "SpecRLConfig":
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                    missing.append(f"{node.name}.{stmt.target.id}")
    assert not missing, missing
    assert dataclasses.is_dataclass(SpecRLConfig)

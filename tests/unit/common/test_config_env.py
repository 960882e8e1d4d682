"""The ``env`` config section: defaults, overrides, bad values refused quoting them, and the
cross-checks against the learner's and the engine's bounds."""

import dataclasses
from pathlib import Path

import pytest

from common.config import load_config, to_yaml
from common.config.env import EnvConfig, env_spec_refusal

DOCS = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_defaults_are_single_turn():
    cfg = load_config([])
    assert cfg.env == EnvConfig() and not cfg.env.enabled
    assert (cfg.env.max_turns, cfg.env.turn_length, cfg.env.on_failure) == (
        8,
        "close",
        "drop_group",
    )
    assert "\nenv:\n  name: ''\n" in to_yaml(cfg)


def test_overrides_compose():
    cfg = load_config(
        [
            "env.name=envs/guess.py:GuessNumber",
            "+env.kwargs={low: 1, high: 100, words: [a, b]}",
            "env.max_turns=3",
            "env.turn_length=end",
            "env.obs_role=tool",
            "env.check_bridge=always",
            "env.on_failure=zero",
            "env.failure_reward=-1",
        ]
    )
    env = cfg.env
    assert env.enabled and env.name == "envs/guess.py:GuessNumber"
    assert env.kwargs == {"low": 1, "high": 100, "words": ["a", "b"]}
    assert (env.max_turns, env.turn_length, env.obs_role) == (3, "end", "tool")
    assert (env.check_bridge, env.on_failure, env.failure_reward) == ("always", "zero", -1.0)
    assert load_config(["env.name=lookup"]).env.name == "lookup"
    assert load_config(["env.name=my_pkg.envs:Env"]).env.enabled


@pytest.mark.parametrize(
    ("override", "quoted"),
    [
        ("env.turn_length=maybe", "'maybe'"),
        ("env.obs_role=system", "'system'"),
        ("env.on_failure=retry", "'retry'"),
        ("env.check_bridge=never", "'never'"),
        ("env.max_turns=0", "0"),
        ("env.max_turn_tokens=0", "0"),
        ("env.max_obs_chars=0", "0"),
        ("env.max_obs_tokens=0", "0"),
        ("env.workers=-1", "-1"),
        ("env.problems_in_flight=-1", "-1"),
        ("env.step_timeout_s=0", "0"),
        ("env.reset_timeout_s=-5", "-5"),
        ("env.name=foo", "'foo'"),
        ("env.name=my-envs:Env", "'my-envs'"),
        ("env.name=envs.py:1Env", "'1Env'"),
        ("env.name=envs.py:", "'envs.py:'"),
        ("env.failure_reward=nan", "nan"),
    ],
)
def test_bad_values_fail_with_the_value_quoted(override, quoted):
    key = override.split("=")[0]
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as err:
        load_config([override])
    assert quoted in str(err.value)


def test_cross_checks_within_the_section():
    with pytest.raises(
        ValueError, match="env.max_turn_tokens=4096 must be <= env.max_total_tokens=2048"
    ):
        load_config(["env.max_turn_tokens=4096"])
    with pytest.raises(
        ValueError, match="env.max_obs_tokens=100 must be below env.max_total_tokens=100"
    ):
        load_config(
            ["env.max_obs_tokens=100", "env.max_total_tokens=100", "env.max_turn_tokens=10"]
        )
    with pytest.raises(ValueError, match="must be <= env.episode_timeout_s=10"):
        load_config(["env.episode_timeout_s=10"])


def test_cross_checks_against_the_learner_and_the_engine():
    with pytest.raises(
        ValueError, match="env.max_total_tokens=2048 must be <= learner.max_seq_tokens=512"
    ):
        load_config(["env.name=lookup", "learner.max_seq_tokens=512"])
    assert load_config(["env.name=lookup", "learner.max_seq_tokens=4096"]).env.enabled
    assert load_config(["env.name=lookup"]).learner.max_seq_tokens == 0  # 0: the model's context
    # Episodes run on the torch engine's turn-request stream (vLLM's: issue 59), in-process.
    with pytest.raises(ValueError, match="runs episodes on the torch engine.*got engine=vllm"):
        load_config(["env.name=lookup", "engine=vllm"])
    assert load_config(["env.name=lookup", "env.workers=2", "env.sandbox=true"]).env.sandbox
    with pytest.raises(ValueError, match="env.sandbox=true confines.*env.workers >= 1"):
        load_config(["env.name=lookup", "env.sandbox=true"])
    with pytest.raises(
        ValueError, match="env.failure_reward=5.0 must be within learner.max_abs_reward=1.0"
    ):
        load_config(["env.name=lookup", "env.failure_reward=5", "learner.max_abs_reward=1"])
    # Without an environment the section's bounds bind nothing.
    load_config(["learner.max_seq_tokens=64", "env.failure_reward=5", "learner.max_abs_reward=1"])


def test_spec_refusal_accepts_the_documented_forms():
    for spec in (
        "lookup",
        "my_envs:Env",
        "pkg.sub.envs:Env",
        "envs/guess.py:GuessNumber",
        "C:/x/e.py:E",
    ):
        assert env_spec_refusal(spec) is None, spec


def test_every_env_field_is_documented():
    text = DOCS.read_text()
    missing = [f.name for f in dataclasses.fields(EnvConfig) if f"env.{f.name}" not in text]
    assert not missing, missing

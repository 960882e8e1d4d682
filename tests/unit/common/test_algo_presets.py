"""The algorithm presets (``algo=...``, configs/algo/) and the checks of the algorithm options."""

from __future__ import annotations

import dataclasses

import pytest

from common.config import SpecRLConfig, load_config
from common.config.learner import LearnerConfig


def changed(option: str) -> dict[str, object]:
    """The learner fields ``algo=option`` sets away from the default config."""
    default = load_config([]).learner
    learner = load_config([f"algo={option}"]).learner
    return {
        f.name: getattr(learner, f.name)
        for f in dataclasses.fields(LearnerConfig)
        if getattr(learner, f.name) != getattr(default, f.name)
    }


def test_default_is_grpo_and_todays_config():
    default = load_config([])
    assert load_config(["algo=grpo"]) == default
    # Today's config: the dataclasses' defaults (every algorithm option at its GRPO value).
    assert default.learner == SpecRLConfig().learner
    lcfg = default.learner
    assert (lcfg.adv_std_norm, lcfg.loss_agg, lcfg.ratio_level) == (True, "token_mean", "token")
    assert (lcfg.clip_eps_high, lcfg.clip_high, lcfg.tis_cap) == (0.0, lcfg.clip_eps, 0.0)
    assert (lcfg.dynamic_sampling, lcfg.overlong, lcfg.lr_schedule) == (False, "none", "constant")


def test_presets_set_what_they_say():
    assert changed("dr_grpo") == {"adv_std_norm": False, "loss_agg": "seq_sum"}
    assert changed("dapo") == {
        "clip_eps_high": 0.28,
        "dynamic_sampling": True,
        "overlong": "penalty",
    }
    assert changed("gspo") == {
        "ratio_level": "sequence",
        "loss_agg": "seq_mean",
        "clip_eps": 3e-4,
        "clip_eps_high": 4e-4,
    }
    # The command line wins over a preset.
    assert load_config(["algo=gspo", "learner.clip_eps=0.1"]).learner.clip_eps == 0.1


@pytest.mark.parametrize(
    ("override", "quoted"),
    [
        ("learner.loss_agg=sum", "'sum'"),
        ("learner.ratio_level=seq", "'seq'"),
        ("learner.overlong=drop", "'drop'"),
        ("learner.lr_schedule=step", "'step'"),
        ("learner.tis_cap=0.5", "0.5"),
        ("learner.lr_min_ratio=1.5", "1.5"),
        ("learner.clip_eps_high=-0.1", "-0.1"),
        ("learner.overlong_buffer=-1", "-1"),
    ],
)
def test_bad_algorithm_values_fail_with_the_value_quoted(override, quoted):
    with pytest.raises(Exception, match=quoted):
        load_config([override])

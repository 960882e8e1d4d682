"""``spec.method=eagle3``'s knobs (common/config/actor.py SpecConfig): defaults, refusals, and
``auto`` left as it was."""

from __future__ import annotations

import pytest

from common.config import load_config
from common.config.actor import SpecConfig


def test_eagle3_loads_with_its_knobs():
    cfg = load_config(["spec.method=eagle3", "spec.eagle_lr=3e-3", "spec.eagle_vocab=64"])
    assert cfg.spec.method == "eagle3" and cfg.spec.uses_eagle
    assert not cfg.spec.uses_early_exit and not cfg.spec.uses_ngram
    assert (cfg.spec.eagle_coef, cfg.spec.eagle_lr, cfg.spec.eagle_vocab) == (1.0, 3e-3, 64)
    vllm = load_config(["spec.method=eagle3", "engine=vllm"])
    assert vllm.spec.method == "eagle3"


def test_auto_is_not_eagle3():
    for engine, method in (("torch", "hybrid"), ("vllm", "early_exit")):
        spec = load_config(["spec.method=auto", f"engine={engine}"]).spec
        assert spec.method == method and not spec.uses_eagle


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["spec.eagle_lr=0"], r"spec\.eagle_lr"),
        (["spec.eagle_coef=-0.5"], r"spec\.eagle_coef"),
        (["spec.eagle_vocab=-1"], r"spec\.eagle_vocab"),
        (["spec.method=eagle3", "spec.adapter=true"], "spec.adapter drafts with the early exit"),
        (
            ["spec.method=eagle3", "learner.model_impl=hf"],
            "spec.method=eagle3 needs the built-in model",
        ),
    ],
)
def test_bad_eagle3_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides)


def test_the_head_is_not_refused_elsewhere():
    # The same knobs are accepted (and unused) by the other methods; builtin is fine with eagle3.
    assert SpecConfig(method="hybrid", eagle_coef=0.0).eagle_coef == 0.0
    assert load_config(["spec.method=eagle3", "learner.model_impl=builtin"]).spec.uses_eagle

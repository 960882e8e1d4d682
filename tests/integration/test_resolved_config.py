"""The config that ran is the config saved: a learner and an actor as OS processes (real Redis,
ZeroMQ), each resolving its config once (common/config/resolve.py) on a machine taken as one
without fast bf16 (the precision layer) and a learner device just big enough for the memory
fit's most frugal settings (the memory layer)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from common import metric_names as mn
from common.config import load_config
from common.config import memory_fit as fit
from common.process_start import CPU_BF16_ENV
from testing.pipeline import Pipeline, warm_model

pytestmark = pytest.mark.integration

STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model(tmp_path_factory.mktemp("model"), steps=40)


def frugal_memory(overrides: list[str], model_dir) -> tuple[fit.Profile, float]:
    """The memory fit's last rung for this run with fp32 kept (slow bf16), and a device size
    (GiB) that it fits and the rung before it does not."""
    cfg = load_config(overrides)
    shape = fit.Shape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    work = fit.Workload.of(cfg, shape, ranks=1)
    rungs = fit.ladder(
        shape, work, fit.Profile.of(cfg.learner), fit.user_set(cfg.learner) | {"precision"}
    )
    frugal = rungs[-1]
    need = fit.estimate(shape, work, frugal)["total"]
    assert fit.estimate(shape, work, rungs[-2])["total"] > need + 4096
    return frugal, (need + 1024) / fit.USABLE_FRACTION / fit.GiB


def body(path) -> dict:
    return yaml.safe_load(path.read_text())


def test_every_process_runs_the_config_it_saved(tmp_path, redis_server, model_dir, monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "slow")
    pipeline = Pipeline.make(
        tmp_path,
        redis_server.url,
        model_dir,
        [f"run.steps={STEPS}", "learner.publish_dtype=bfloat16", "actor.prompts_per_batch=4"],
    )
    frugal, memory_gib = frugal_memory(pipeline.overrides, model_dir)
    assert frugal.precision == "fp32" and frugal.max_tokens_per_microbatch > 0
    pipeline.overrides.append(f"learner.device_memory_gib={memory_gib!r}")
    asked = load_config(pipeline.overrides)
    pipeline.run_to_end(actors=1, timeout_s=300)
    assert pipeline.actors[0].returncode == 0, pipeline.log_tail("actor-0")

    resolved = tmp_path / "resolved"
    [actor_file] = resolved.glob("actor-*.yaml")
    learner_saved, actor_saved = body(resolved / "learner.yaml"), body(actor_file)
    # What each layer changed, and nothing else: the learner's memory settings (the most frugal
    # rung, fp32 kept on a CPU taken as slow at bf16) and the actor's torch dtype.
    picked = dataclasses.asdict(frugal)
    for name, value in picked.items():
        assert learner_saved["learner"][name] == value
    assert fit.Profile.of(asked.learner) != frugal  # the asked config differs: the fit changed it
    assert (asked.engine.torch_dtype, actor_saved["engine"]["torch_dtype"]) == ("auto", "float32")
    assert learner_saved["engine"]["torch_dtype"] == "auto"  # not the learner's section
    header = "".join(
        x for x in (resolved / "learner.yaml").read_text().splitlines(True) if x[0] == "#"
    )
    assert "(memory: learner.profile=auto: estimate" in header
    assert "(precision: this CPU has no bf16" in actor_file.read_text()
    # Each process compared the config it ran with, at its end, against the file it saved.
    for name in ("learner", "actor-0"):
        log = (tmp_path / f"{name}.log").read_text()
        assert "ran with the resolved config saved in" in log, pipeline.log_tail(name)
        assert "differs from" not in log
    # And the learner trained with the picked micro-batch budget: several per step.
    steps = pipeline.steps()
    assert len(steps) == STEPS
    assert all(s[mn.LEARNER_MICROBATCHES] > 1 for s in steps)

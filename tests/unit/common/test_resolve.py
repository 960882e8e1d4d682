"""The resolve step (common/config/resolve.py) as a pure function, and the process side that saves
what it resolved and checks, at the end, that the process ran with it (common/process_start.py)."""

from __future__ import annotations

import copy
import logging

from common import process_start
from common.config import load_config, to_yaml
from common.config.memory_fit import GiB, Profile
from common.config.resolve import Facts, MemoryFacts, resolve
from testing.shapes import QWEN25_7B

SHAPE_7B = QWEN25_7B


def seven_b_memory(gib: float, ranks: int = 4) -> MemoryFacts:
    from common.config.memory_fit import Shape
    from common.model_args import ModelArgs

    shape = Shape.from_hf_config(ModelArgs(**SHAPE_7B).to_hf_config())
    return MemoryFacts(shape, gib * GiB, "test", ranks, "qwen7b")


def test_resolve_returns_a_copy_and_says_what_changed_and_why():
    cfg = load_config(["learner.device_memory_gib=80"])
    before = to_yaml(cfg)
    out = resolve(cfg, Facts("learner", memory=seven_b_memory(80)), [])
    assert to_yaml(cfg) == before  # pure: the asked config is untouched
    assert Profile.of(out.cfg.learner) == Profile("bf16-mixed", 16384, True, 1024)
    assert {c.layer for c in out.changes} == {"memory"}
    assert {c.key for c in out.changes} == {
        "learner.precision",
        "learner.max_tokens_per_microbatch",
        "learner.activation_checkpointing",
    }
    table = out.table()
    assert (
        "learner.precision" in table and "fp32 -> bf16-mixed (memory: learner.profile=auto" in table
    )
    assert out.changed()["learner.activation_checkpointing"] is True


def test_the_memory_fit_never_picks_bf16_where_the_cpu_emulates_it():
    """The layers in order: the precision layer's fact binds the memory layer, which would
    otherwise pick bf16-mixed to fit (it did above, with the same memory)."""
    cfg = load_config(["learner.device_memory_gib=80"])
    out = resolve(cfg, Facts("learner", bf16_fast=False, memory=seven_b_memory(80)), [])
    assert out.cfg.learner.precision == "fp32"
    assert out.cfg.learner.activation_checkpointing is True  # it fits another way
    # An actor's resolution never runs the learner's memory fit.
    actor = resolve(cfg, Facts("actor", bf16_fast=False, memory=seven_b_memory(1)), [])
    assert actor.changes == []


def test_a_process_saves_the_resolved_config_and_checks_it_at_the_end(
    tmp_path, caplog, monkeypatch
):
    args = ["model=smollm2-135m", f"run.dir={tmp_path}", "actor.actor_id=a/1"]
    cfg = load_config(args)
    caplog.set_level(logging.INFO, logger="common.process_start")
    monkeypatch.setenv(process_start.CPU_BF16_ENV, "slow")  # as a CPU without AVX512-BF16
    resolution = process_start.prepare(cfg, args, "actor")
    path = tmp_path / "resolved" / "actor-a_1.yaml"  # the id made a file name
    assert [c.key for c in resolution.changes] == ["engine.torch_dtype"]
    assert cfg.engine.torch_dtype == "float32"  # in place: every holder of cfg sees it
    assert process_start.saved_config(path) == process_start.redacted_yaml(cfg)
    assert process_start.check_saved(cfg, "actor")
    assert "ran with the resolved config saved in" in caplog.text
    changed = copy.deepcopy(cfg)
    changed.actor.group_size += 1  # something changing the config after the resolve step
    caplog.clear()
    assert not process_start.check_saved(changed, "actor")
    assert "differs from" in caplog.text and "group_size" in caplog.text
    other = load_config([f"run.dir={tmp_path / 'other'}"])
    assert process_start.check_saved(other, "learner")  # nothing saved by this process: no check

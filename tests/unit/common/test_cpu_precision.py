"""bf16 compute moves to fp32 on a CPU without bf16 matrix instructions, unless the user named it."""

from __future__ import annotations

import logging

import pytest
import torch

from common import cpu_precision, gpu_start
from common.config import load_config

PRESET = ["model=smollm2-135m"]  # learner.precision=bf16-mixed, learner.publish_dtype=bfloat16


@pytest.fixture
def slow_bf16(monkeypatch):
    monkeypatch.setattr(cpu_precision, "bf16_is_fast", lambda device: False)


def test_the_preset_computes_in_fp32_on_a_cpu_without_fast_bf16(slow_bf16, caplog):
    learner = load_config(PRESET)
    assert learner.learner.precision == "bf16-mixed"
    with caplog.at_level(logging.WARNING, logger="common.cpu_precision"):
        gpu_start.prepare(learner, PRESET, "learner")
    assert learner.learner.precision == "fp32"
    assert learner.learner.publish_dtype == "bfloat16"  # the published versions are unchanged
    actor = load_config(PRESET)
    gpu_start.prepare(actor, PRESET, "actor")
    assert actor.engine.torch_dtype == "float32"
    assert actor.learner.precision == "bf16-mixed"  # each process changes its own sections
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "no bf16 matrix instructions" in said and "learner.precision=fp32" in said


def test_a_setting_named_on_the_command_line_stays(slow_bf16):
    overrides = [*PRESET, "learner.precision=bf16-mixed", "engine.torch_dtype=auto"]
    cfg = load_config(overrides)
    assert cpu_precision.prepare(cfg, overrides, "learner", cuda=False) == {}
    assert cpu_precision.prepare(cfg, overrides, "actor", cuda=False) == {}
    assert (cfg.learner.precision, cfg.engine.torch_dtype) == ("bf16-mixed", "auto")
    plus = [*PRESET, "++learner.precision=bf16"]
    cfg = load_config(plus)
    assert cpu_precision.prepare(cfg, plus, "learner", cuda=False) == {}
    assert cfg.learner.precision == "bf16"


def test_nothing_changes_where_bf16_is_fast_on_cuda_or_not_in_use(monkeypatch):
    monkeypatch.setattr(cpu_precision, "bf16_is_fast", lambda device: True)
    cfg = load_config(PRESET)
    assert cpu_precision.prepare(cfg, PRESET, "learner", cuda=False) == {}
    assert cfg.learner.precision == "bf16-mixed"
    monkeypatch.setattr(cpu_precision, "bf16_is_fast", lambda device: False)
    assert cpu_precision.prepare(cfg, PRESET, "learner", cuda=True) == {}
    assert cfg.learner.precision == "bf16-mixed"
    plain = load_config([])  # fp32 training, fp32 publishing: nothing to move
    assert cpu_precision.prepare(plain, [], "learner", cuda=False) == {}
    assert cpu_precision.prepare(plain, [], "actor", cuda=False) == {}
    vllm = load_config([*PRESET, "engine=vllm"])  # the vLLM engine picks its own dtype
    assert cpu_precision.fp32_changes(vllm, [], "actor") == {}


def test_the_bf16_check_reads_onednn_and_counts_a_missing_check_as_slow(monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no mkldnn")
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert cpu_precision.bf16_is_fast(cpu) is True
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert cpu_precision.bf16_is_fast(cpu) is False

    def missing():
        raise AttributeError("no _is_mkldnn_bf16_supported")

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", missing)
    assert cpu_precision.bf16_is_fast(cpu) is False

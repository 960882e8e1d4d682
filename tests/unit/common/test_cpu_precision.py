"""bf16 compute moves to fp32 on a CPU without bf16 matrix instructions, unless the user named it
(the resolve step's precision layer, common/config/resolve.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from common import cpu_precision, process_start
from common.config import load_config
from common.config.resolve import Facts, precision_changes, resolve

PRESET = ["model=smollm2-135m"]  # learner.precision=bf16-mixed, learner.publish_dtype=bfloat16


@pytest.fixture
def slow_bf16(monkeypatch):
    monkeypatch.setattr(cpu_precision, "bf16_is_fast", lambda device: False)


def test_the_preset_computes_in_fp32_on_a_cpu_without_fast_bf16(slow_bf16, caplog, tmp_path):
    args = [*PRESET, f"run.dir={tmp_path}"]
    learner = load_config(args)
    assert learner.learner.precision == "bf16-mixed"
    with caplog.at_level(logging.INFO, logger="common.process_start"):
        process_start.prepare(learner, args, "learner")
    assert learner.learner.precision == "fp32"
    assert learner.learner.publish_dtype == "bfloat16"  # the published versions are unchanged
    actor = load_config(args)
    process_start.prepare(actor, args, "actor")
    assert actor.engine.torch_dtype == "float32"
    assert actor.learner.precision == "bf16-mixed"  # each process changes its own sections
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "no bf16 matrix instructions" in said
    assert "learner.precision" in said and "bf16-mixed -> fp32 (precision:" in said
    saved = (tmp_path / "resolved" / "learner.yaml").read_text()
    assert "# resolve step: 1 settings changed" in saved and "precision: fp32" in saved


SLOW = {"bf16_fast": False}


def test_a_setting_named_on_the_command_line_stays():
    overrides = [*PRESET, "learner.precision=bf16-mixed", "engine.torch_dtype=auto"]
    cfg = load_config(overrides)
    for role in ("learner", "actor"):
        assert resolve(cfg, Facts(role, **SLOW), overrides).changes == []
    plus = [*PRESET, "++learner.precision=bf16"]
    cfg = load_config(plus)
    resolved = resolve(cfg, Facts("learner", **SLOW), plus).cfg
    assert resolved.learner.precision == "bf16"


def test_nothing_changes_where_bf16_is_fast_on_cuda_or_not_in_use():
    cfg = load_config(PRESET)
    assert resolve(cfg, Facts("learner", bf16_fast=True), PRESET).changes == []
    cuda = Facts("learner", devices=process_start.Devices(cuda=True), **SLOW)
    assert resolve(cfg, cuda, PRESET).changes == []  # no model.path: no GPU profile either
    plain = load_config([])  # fp32 training, fp32 publishing: nothing to move
    for role in ("learner", "actor"):
        assert resolve(plain, Facts(role, **SLOW), []).changes == []
    vllm = load_config([*PRESET, "engine=vllm"])  # the vLLM engine picks its own dtype
    assert precision_changes(vllm, [], "actor") == {}
    assert cfg.learner.precision == "bf16-mixed"  # resolve returns a copy: the input is kept


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

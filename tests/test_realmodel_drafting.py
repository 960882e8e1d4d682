"""benchmarks/realmodel.py names the drafting each of its runs used: the preset as it is, on the
torch engine and on vLLM, resolves to the trained adapter (hybrid on torch, alone on vLLM)."""

from __future__ import annotations

import json

from benchmarks.realmodel import PRESET, draft_used
from common.model import DRAFT_FILE


def test_each_run_records_its_spec_and_which_draft(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    preset = [*PRESET, f"model.path={model}"]
    assert draft_used(preset) == {
        "spec": "hybrid",
        "draft": "an untrained draft adapter (a copy of layer 1) + n-gram (group)",
        "adaptive": True,
        "k": 4,
    }
    (model / DRAFT_FILE).parent.mkdir()
    (model / DRAFT_FILE).write_bytes(b"")
    trained = f"the trained draft adapter ({DRAFT_FILE} of the model directory)"
    assert draft_used([*preset, "engine=vllm"])["spec"] == "early_exit"
    assert draft_used([*preset, "engine=vllm"])["draft"] == trained
    assert draft_used(preset)["draft"] == f"{trained} + n-gram (group)"
    # What the workaround gave: the bare early exit, without the adapter.
    bare = draft_used([*preset, "engine=vllm", "spec=early_exit"])
    assert bare["draft"] == "the policy's first 1 layer(s) (early exit, no adapter)"
    assert draft_used([*preset, "spec=none"])["draft"] == "none (plain decoding)"

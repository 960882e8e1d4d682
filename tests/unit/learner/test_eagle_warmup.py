"""``specrl warm-draft spec.method=eagle3`` (learner/prepare/eagle_warmup.py): its records and loss are the
learner's, it raises the held-out acceptance of a briefly trained tiny model and saves a head that
loads back beside untouched model tensors, the command runs end to end, and bad input is refused."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import torch

from common.config import load_config
from common.eagle import EAGLE_FILE, attach_eagle
from common.model import load_pretrained
from learner.eagle_loss import eagle_terms
from learner.policy import backbone
from learner.prepare.draft_data import Decoding, WarmDraftError, WarmDraftOptions, sample_group
from learner.prepare.draft_warmup import warm_draft
from learner.prepare.eagle_warmup import (
    EAGLE_SUMMARY_FILE,
    batch_inputs,
    head_outputs,
    restricted_kl_sum,
    teacher_states,
)
from learner.prepare.warm_start import default_model_dir
from ops.cli import main
from testing.models import random_model
from testing.warm_draft import FAST, TINY, assert_draft_saved_beside_untouched_model, digest

EAGLE = ["spec.method=eagle3"]


def test_records_and_loss_are_the_learners():
    model = random_model(vocab_size=11, num_hidden_layers=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)
    prompts = [[1, 5, 2, 4, 7], [1], [1, 6, 6, 2]]  # one one-token prompt
    decoding = Decoding(max_new_tokens=6, exit_layer=1, eos_id=3, temperature=1.0, top_p=1.0)
    samples = sample_group(model, prompts, 2, decoding, torch.Generator().manual_seed(0))
    attach_eagle(model, vocab_ids=torch.tensor([0, 2, 3, 5, 8, 9]), seed=1)
    records = teacher_states(model, samples, batch=4)
    ids, aux, mask, h_next = batch_inputs(records, torch.device("cpu"))
    assert ids.shape == aux.shape[:2] and aux.shape[2] == 3 * 64  # vLLM's inputs (0, 1, 2)
    # The head's outputs, as the warm-up's, for the first draft step and the unrolled second.
    (h_next2, prenorm), second = head_outputs(model, records, steps=2)
    torch.testing.assert_close(h_next2, h_next)
    with torch.no_grad():
        warm = restricted_kl_sum(model, h_next, prenorm, 0.8, chunk=5)
        warm2 = warm + restricted_kl_sum(model, *second, 0.8, chunk=5)
    # The learner's step over the same rows: completion positions are its mask.
    learner_kl, learner_kl2, positions = 0.0, 0.0, 0
    for s in samples:
        row = torch.tensor([s.prompt + s.completion])
        sel = torch.zeros(1, row.shape[1] - 1, dtype=torch.bool)
        sel[0, len(s.prompt) - 1 :] = True
        taps: list[torch.Tensor] = []
        with torch.no_grad():
            h, _ = backbone(model, row, aux=taps)
            kl, _, n = eagle_terms(model, row, taps, h, sel, 0.8, 0)
            kl2, _, _ = eagle_terms(model, row, taps, h, sel, 0.8, 0, steps=2)
        learner_kl, positions = learner_kl + float(kl), positions + n
        learner_kl2 += float(kl2)
    assert positions == h_next.shape[0] == int(mask.sum())
    assert float(warm) == pytest.approx(learner_kl, rel=1e-4)
    assert 0 < second[0].shape[0] < positions  # a one-token prompt's first target is not there
    assert float(warm2) == pytest.approx(learner_kl2, rel=1e-4)


def test_warm_up_raises_held_out_acceptance_and_saves_the_head(tiny_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    weights = digest(model_dir / "model.safetensors")
    cfg = load_config([*TINY, *EAGLE, "spec.eagle_vocab=30", f"model.path={model_dir}"])
    opts = WarmDraftOptions(prompts=24, epochs=4, summary=tmp_path / "summary.json")
    policy, summary = warm_draft(cfg, opts)
    assert summary["method"] == "eagle3" and summary["draft_vocab"] == 30
    assert summary["acceptance_after"] > summary["acceptance_before"] + 0.05, summary
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == summary["steps"]
    assert digest(model_dir / "model.safetensors") == weights
    loaded = load_pretrained(model_dir)
    assert loaded.args.eagle_aux_layers == policy.args.eagle_aux_layers
    assert loaded.args.eagle_vocab_size == 30 and loaded.eagle.vocab_ids.numel() == 30
    assert_draft_saved_beside_untouched_model(loaded, policy, "eagle", tiny_dir)


def test_command_runs_end_to_end_on_the_tiny_default(tiny_dir, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_dir, default_model_dir(load_config(TINY)))
    argv = ["warm-draft", *TINY, *EAGLE, *FAST, "--epochs", "1", "--out", "copy"]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    assert "acceptance_after" in stdout.getvalue()
    (model_dir,) = (tmp_path / "runs" / "models").iterdir()
    assert not (model_dir / EAGLE_FILE).exists()  # --out: the model directory untouched
    summary = json.loads((tmp_path / "copy" / EAGLE_SUMMARY_FILE).read_text())
    assert summary["command"].startswith("specrl warm-draft")
    loaded = load_pretrained(tmp_path / "copy")
    assert loaded.eagle is not None and loaded.args.eagle_vocab_size == 0  # whole vocabulary


def test_a_vocabulary_above_the_models_is_refused(tiny_dir):
    cfg = load_config([*EAGLE, "spec.eagle_vocab=100000", f"model.path={tiny_dir}"])
    with pytest.raises(WarmDraftError, match="spec.eagle_vocab=100000 exceeds"):
        warm_draft(cfg, WarmDraftOptions(prompts=4))

"""``specrl warm-draft`` (learner/prepare/draft_warmup.py): the states recorded while sampling are the
teacher-forced ones, the loss is the learner's, the warm-up raises the held-out acceptance of a
briefly trained tiny model and saves an adapter that loads back beside untouched model tensors,
the command runs end to end, and bad input is refused before any sampling."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from common.config import load_config
from common.model import DRAFT_FILE, attach_draft, load_pretrained
from learner.draft_loss import adapter_kl_sum, draft_states
from learner.prepare.draft_data import (
    Decoding,
    WarmDraftError,
    WarmDraftOptions,
    coverage,
    draft_vocabulary,
    sample_group,
    tokens_per_verify,
    turn_end_ids,
)
from learner.prepare.draft_warmup import restricted_kl_sum, warm_draft
from learner.prepare.warm_start import default_model_dir
from ops.cli import main
from testing.models import random_model
from testing.warm_draft import FAST, TINY, assert_draft_saved_beside_untouched_model, digest


def test_states_recorded_while_sampling_are_the_teacher_forced_ones():
    # Near-uniform over 8 tokens: EOS (3) ends rows at different steps, others run to the budget.
    model = random_model(vocab_size=8, num_hidden_layers=3)
    prompts = [[1, 5, 2, 4, 7], [1, 3], [1, 6, 6, 2, 6, 0, 7]]  # right-padded together
    decoding = Decoding(max_new_tokens=12, exit_layer=2, eos_id=3, temperature=1.0, top_p=1.0)
    samples = sample_group(model, prompts, 2, decoding, torch.Generator().manual_seed(0))
    assert [s.prompt for s in samples] == [p for p in prompts for _ in range(2)]
    assert len({len(s.completion) for s in samples}) > 1
    for s in samples:
        p, c = len(s.prompt), len(s.completion)
        assert c == 12 or s.completion[-1] == 3
        ids = torch.tensor([s.prompt + s.completion[:-1]])
        with torch.no_grad():
            h_exit = model.run_layers(model.model.embed_tokens(ids), None, None, 0, 2)
            full = model.model.norm(model.run_layers(h_exit, None, None, 2, 3))
        assert s.exit_states.shape == (p + c - 1, 64)
        torch.testing.assert_close(s.exit_states, h_exit[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s.full_states, full[0, p - 1 :], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("vocab", [torch.tensor([0, 3, 5, 7, 11, 40, 96]), None])
def test_restricted_loss_is_the_learners_loss(vocab):
    model = random_model(vocab_size=97)
    attach_draft(model, 1, vocab)
    model.requires_grad_(False)
    model.draft.requires_grad_(True)
    h_exit, h_full = torch.randn(2, 9, 64), torch.randn(10, 64)
    values, grads = [], []
    for loss in (adapter_kl_sum, restricted_kl_sum):
        model.zero_grad()
        d = draft_states(model, h_exit).reshape(-1, 64)[:10]
        value = loss(model, h_full, d, 0.7, 4)
        value.backward()
        values.append(value.item())
        grads.append([p.grad.clone() for p in model.draft.parameters()])
    assert values[0] == pytest.approx(values[1], rel=1e-5)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_vocabulary_keeps_end_ids_then_frequent_tokens_then_fills_up():
    completions = [[5, 5, 5, 6, 6, 7], [5, 6, 8]]
    ids = draft_vocabulary(completions, [[9, 9, 4]], 5, 20, keep={2})
    assert ids.tolist() == [2, 5, 6, 7, 8]  # 7 and 8 once each: both fit
    assert draft_vocabulary(completions, [[9, 9, 4]], 8, 20, keep={2}).tolist() == [
        *[0, 2, 4, 5, 6, 7, 8, 9]  # prompts' tokens, then the lowest id
    ]
    assert draft_vocabulary(completions, [], 0, 20, keep={2}) is None
    assert coverage(torch.tensor([5, 6]), completions) == pytest.approx(7 / 9)
    assert coverage(None, completions) == 1.0
    assert tokens_per_verify(0.5, 4) == pytest.approx(1.9375)
    assert tokens_per_verify(1.0, 4) == 5.0


def test_warm_up_raises_held_out_acceptance_and_saves_the_adapter(tiny_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    weights = digest(model_dir / "model.safetensors")
    cfg = load_config([*TINY, f"model.path={model_dir}"])
    opts = WarmDraftOptions(prompts=24, epochs=4, summary=tmp_path / "summary.json")
    policy, summary = warm_draft(cfg, opts)
    assert summary["acceptance_after"] > summary["acceptance_before"] + 0.02
    assert summary["exit_layer"] == 1  # a fifth of 4 layers, at least 1
    assert summary["draft_vocab"] == summary["vocab_size"]  # 8192 capped: the whole vocabulary
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == summary["steps"]
    assert digest(model_dir / "model.safetensors") == weights
    loaded = load_pretrained(model_dir)
    assert loaded.args.draft_exit_layer == 1
    # The adapter is the one trained; everything else is the model that was there before.
    assert_draft_saved_beside_untouched_model(loaded, policy, "draft", tiny_dir)


def test_command_runs_end_to_end_on_the_tiny_default(tiny_dir, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the default model lives under ./runs/models: built already
    shutil.copytree(tiny_dir, default_model_dir(load_config(TINY)))
    argv = ["warm-draft", *TINY, "spec.adapter_vocab=30", *FAST]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    (model_dir,) = (tmp_path / "runs" / "models").iterdir()
    assert f"draft adapter written to {model_dir.relative_to(tmp_path)}" in stdout.getvalue()
    assert "acceptance_after" in stdout.getvalue()
    summary = json.loads((model_dir / "draft_warmup.json").read_text())
    assert summary["draft_vocab"] == 30 and summary["command"].startswith("specrl warm-draft")
    assert summary["heldout_samples"] == 6 and summary["train_samples"] == 42
    loaded = load_pretrained(model_dir)
    assert loaded.draft.vocab_ids.numel() == 30
    # --out: a copy of the model directory with the adapter, the model directory untouched.
    draft = digest(model_dir / DRAFT_FILE)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*argv, "spec.exit_layer=2", "--epochs", "1", "--out", "copy"]) == 0
    assert load_pretrained(tmp_path / "copy").args.draft_exit_layer == 2
    assert digest(model_dir / DRAFT_FILE) == draft
    assert main(["warm-draft", "--help"]) == 0


def test_bad_input_is_refused_before_sampling(tiny_dir, tmp_path, capsys):
    hf_only = tmp_path / "gpt2"
    hf_only.mkdir()
    (hf_only / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    cases = [
        ([f"model.path={hf_only}"], "the built-in Transformer cannot load"),
        ([f"model.path={tiny_dir}", "spec.exit_layer=4"], "spec.exit_layer=4 is out of range"),
        ([f"model.path={tiny_dir}", "spec.adapter_vocab=46"], "exceeds the model's vocabulary"),
        ([f"model.path={tiny_dir}", "--prompts", "1"], "--prompts must be >= 2"),
    ]
    for overrides, message in cases:
        assert main(["warm-draft", *overrides]) == 2
        err = capsys.readouterr().err
        assert err.startswith("specrl warm-draft: ") and message in err, err
        assert "sampling" not in err
    assert not (tiny_dir / DRAFT_FILE).exists()
    with pytest.raises(WarmDraftError, match="--holdout"):
        warm_draft(load_config([f"model.path={tiny_dir}"]), WarmDraftOptions(holdout=1.0))


class _ChatTokenizer:
    """A tokenizer whose chat template renders ``rendered`` (or raises it, if an exception)."""

    def __init__(self, rendered: object) -> None:
        def apply_chat_template(messages: list[dict], tokenize: bool) -> list[int]:
            if isinstance(rendered, Exception):
                raise rendered
            return rendered

        self._tokenizer = SimpleNamespace(
            chat_template="{{ messages }}", apply_chat_template=apply_chat_template
        )

    def encode(self, text: str) -> list[int]:
        return [42] if text == "42" else [7]


def test_turn_end_ids_are_what_follows_the_reply() -> None:
    assert turn_end_ids(_ChatTokenizer([1, 9, 7, 2, 42, 5, 3])) == {5, 3}


def test_a_chat_template_that_fails_is_logged_not_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="learner.prepare.draft_warmup"):
        assert turn_end_ids(_ChatTokenizer(ValueError("no such variable"))) == set()
    assert "chat template did not render" in caplog.text
    assert "ValueError: no such variable" in caplog.text

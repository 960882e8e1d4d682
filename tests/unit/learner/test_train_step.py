"""One learner step on real groups: every trainable parameter moves; checkpoints round-trip."""

import numpy as np
import torch

from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.batch import collate
from learner.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    restore_optimizer,
    save_checkpoint,
)
from learner.optim import make_optimizer
from learner.step import LossPlan, Trainer
from testing.groups import make_groups
from testing.models import tiny_model


def test_collate_aligns_targets_and_masks():
    vocab = 20
    groups = make_groups(vocab)
    batch = collate(groups, learner_version=1, pad_id=0, device=torch.device("cpu"))
    row = 0
    for group in groups:
        p = len(group.prompt_ids)
        for c in group.completions:
            t = len(c.token_ids)
            idx = batch.mask[row].nonzero().squeeze(-1)
            assert idx.tolist() == list(range(p - 1, p - 1 + t))
            assert batch.targets[row, idx].tolist() == c.token_ids.tolist()
            np.testing.assert_allclose(
                batch.behaviour_logprobs[row, idx].numpy(), c.behaviour_logprobs
            )
            row += 1
    assert batch.staleness.tolist() == [1, 1, 1]
    assert torch.allclose(batch.advantages.view(3, 4).sum(-1), torch.zeros(3), atol=1e-5)


def test_one_step_changes_every_parameter():
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    model = tiny_model(tokenizer.vocab_size)
    cfg = LearnerConfig(lr=1e-3)
    optimizer = make_optimizer(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = collate(make_groups(tokenizer.vocab_size), 0, tokenizer.pad_id, torch.device("cpu"))
    metrics = Trainer(model, optimizer, cfg, SamplingConfig()).step(batch)
    unchanged = [n for n, p in model.named_parameters() if torch.equal(before[n], p.detach())]
    assert not unchanged, f"parameters not updated: {unchanged}"
    assert np.isfinite(metrics["learner/loss"]) and metrics["learner/grad_norm"] > 0


def test_a_trainer_resolves_its_loss_plan_once_and_steps_as_fresh_trainers_do(monkeypatch):
    """A learner's trainer works out what its loss is made of at start, not every step, and its
    steps are bit-for-bit those of trainers made afresh for each step (each resolving its own
    plan) on a copy of the same model."""
    import copy

    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    cfg = LearnerConfig(lr=1e-3)
    model = tiny_model(tokenizer.vocab_size)
    twin = copy.deepcopy(model)
    batches = [
        collate(
            make_groups(tokenizer.vocab_size, version=v), v, tokenizer.pad_id, torch.device("cpu")
        )
        for v in range(3)
    ]
    resolved = []
    real = LossPlan.resolve.__func__
    monkeypatch.setattr(
        LossPlan, "resolve", classmethod(lambda c, *a: resolved.append(1) or real(c, *a))
    )
    trainer = Trainer(model, make_optimizer(model, cfg), cfg, SamplingConfig())
    figures = [trainer.step(b) for b in batches]
    assert len(resolved) == 1
    optimizer = make_optimizer(twin, cfg)
    one_off = [Trainer(twin, optimizer, cfg, SamplingConfig()).step(b) for b in batches]
    assert len(resolved) == 4  # a fresh trainer resolves its own
    assert figures == one_off
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_zero_advantage_step_changes_nothing():
    # The test above can fail: with equal rewards GRPO gives no signal and nothing moves.
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    model = tiny_model(tokenizer.vocab_size)
    cfg = LearnerConfig(lr=1e-3)
    optimizer = make_optimizer(model, cfg)
    groups = make_groups(tokenizer.vocab_size)
    for group in groups:
        for c in group.completions:
            c.reward = 1.0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    Trainer(model, optimizer, cfg, SamplingConfig()).step(
        collate(groups, 0, 0, torch.device("cpu"))
    )
    assert all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())


def test_checkpoint_round_trip(tmp_path):
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    model = tiny_model(tokenizer.vocab_size)
    cfg = LearnerConfig(lr=1e-3)
    optimizer = make_optimizer(model, cfg)
    batch = collate(make_groups(tokenizer.vocab_size), 0, 0, torch.device("cpu"))
    Trainer(model, optimizer, cfg, SamplingConfig()).step(batch)
    dedupe = {"format": 1, "actors": {"a": {"floor": 2, "above": []}}}
    path = save_checkpoint(tmp_path, model, tokenizer, optimizer, TrainerState(7, 9, dedupe))
    assert latest_checkpoint(tmp_path) == path
    loaded, opt_tensors, state, groups = load_checkpoint(path, torch.device("cpu"))
    assert (state.step, state.version, state.dedupe) == (7, 9, dedupe)
    for (n, p), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert n == n2 and torch.equal(p.detach(), p2.detach())
    # The restored optimizer continues exactly like the original one.
    opt2 = make_optimizer(loaded, cfg)
    restore_optimizer(loaded, opt2, opt_tensors, groups)
    Trainer(model, optimizer, cfg, SamplingConfig()).step(batch)
    Trainer(loaded, opt2, cfg, SamplingConfig()).step(batch)
    for p, p2 in zip(model.parameters(), loaded.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), p2.detach(), atol=1e-6, rtol=1e-5)
    # Only the newest checkpoints are kept.
    for step in (8, 9, 10):
        save_checkpoint(tmp_path, model, tokenizer, optimizer, TrainerState(step, step, {}))
    assert [p.name for p in sorted(tmp_path.glob("step_*"))] == ["step_00000009", "step_00000010"]


def test_early_exit_aux_loss_reduces_exit_divergence():
    # Equal rewards: no policy gradient, so only the co-training loss moves the weights.
    from common.config.actor import SpecConfig

    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    model = tiny_model(tokenizer.vocab_size)
    cfg = LearnerConfig(lr=3e-3)
    spec = SpecConfig(method="early_exit", exit_layer=1, aux_coef=1.0)
    optimizer = make_optimizer(model, cfg)
    groups = make_groups(tokenizer.vocab_size)
    for group in groups:
        for c in group.completions:
            c.reward = 0.5
    batch = collate(groups, 0, 0, torch.device("cpu"))
    kls = [
        Trainer(model, optimizer, cfg, SamplingConfig(), spec=spec).step(batch)["spec/exit_kl"]
        for _ in range(30)
    ]
    assert kls[0] > 0
    assert kls[-1] < 0.5 * kls[0], kls


def test_tokens_outside_the_nucleus_leave_the_loss_instead_of_nan():
    # Random tokens under top-p 0.3: many are outside the learner's nucleus (log-prob -inf).
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    model = tiny_model(tokenizer.vocab_size)
    cfg = LearnerConfig(lr=1e-3, kl_coef=0.1)
    optimizer = make_optimizer(model, cfg)
    ref = tiny_model(tokenizer.vocab_size)
    batch = collate(make_groups(tokenizer.vocab_size), 0, 0, torch.device("cpu"))
    metrics = Trainer(model, optimizer, cfg, SamplingConfig(top_p=0.3), ref_model=ref).step(batch)
    assert 0 < metrics["learner/outside_nucleus_frac"] < 1
    assert np.isfinite(metrics["learner/loss"])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_step_with_a_non_finite_loss_is_skipped_and_changes_nothing():
    """Defence in depth behind admission: an inf reward gives NaN advantages; the step is
    skipped and counted, the weights (and the optimizer state) stay as they were."""
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    model = tiny_model(tokenizer.vocab_size)
    cfg = LearnerConfig(lr=1e-3)
    optimizer = make_optimizer(model, cfg)
    groups = make_groups(tokenizer.vocab_size)
    groups[0].completions[0].reward = 1e300  # inf in float32
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = collate(groups, 0, tokenizer.pad_id, torch.device("cpu"))
    metrics = Trainer(model, optimizer, cfg, SamplingConfig()).step(batch)
    assert metrics["learner/skipped"] == 1.0
    assert all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    assert not optimizer.state, "a skipped step must not touch the optimizer state"
    # The next finite batch trains as usual.
    ok = collate(make_groups(tokenizer.vocab_size), 0, tokenizer.pad_id, torch.device("cpu"))
    assert Trainer(model, optimizer, cfg, SamplingConfig()).step(ok)["learner/skipped"] == 0.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_checkpoint_keeps_training_state_apart_and_reads_the_older_layout(tmp_path):
    from transformers import AutoModelForCausalLM

    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    model = tiny_model(tokenizer.vocab_size)
    cfg = LearnerConfig(lr=1e-3)
    optimizer = make_optimizer(model, cfg)
    Trainer(model, optimizer, cfg, SamplingConfig()).step(
        collate(make_groups(tokenizer.vocab_size), 0, 0, torch.device("cpu"))
    )
    path = save_checkpoint(tmp_path, model, tokenizer, optimizer, TrainerState(3, 4, {}))
    # Model loaders read every *.safetensors at the top: only the policy is there.
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["model.safetensors"]
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert hf.config.num_hidden_layers == model.args.num_hidden_layers
    # A checkpoint of the older layout (training files beside the model) still loads.
    for f in (path / "training_state").iterdir():
        f.rename(path / f.name)
    (path / "training_state").rmdir()
    _, tensors, state, _ = load_checkpoint(path, torch.device("cpu"))
    assert (state.step, state.version) == (3, 4) and tensors

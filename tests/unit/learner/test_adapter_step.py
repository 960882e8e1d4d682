"""The draft adapter in the learner's step: it learns, the policy's update does not change, and
it survives a checkpoint and a resume with its own optimizer group."""

import copy

import torch

from common import metric_names as mn
from common.config.actor import SpecConfig
from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.model import DRAFT_FILE, attach_draft
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.batch import collate
from learner.optim import make_optimizer
from learner.step import Trainer
from testing.checkpoints import assert_next_step_matches, checkpoint_round_trip
from testing.groups import make_groups
from testing.models import tiny_model

SPEC = SpecConfig(method="early_exit", exit_layer=1, adapter=True, aux_coef=0.5, adapter_lr=3e-3)


def _setup(adapter: bool):
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    model = tiny_model(tokenizer.vocab_size)
    if adapter:
        attach_draft(model, 1, torch.arange(0, tokenizer.vocab_size, 2))
    batch = collate(make_groups(tokenizer.vocab_size), 0, tokenizer.pad_id, torch.device("cpu"))
    return tokenizer, model, batch


def test_adapter_learns_and_leaves_the_policy_update_unchanged():
    cfg = LearnerConfig(lr=1e-3, grad_clip=0.05)  # a clip that binds: norms must stay apart
    _, with_adapter, batch = _setup(adapter=True)
    plain = copy.deepcopy(with_adapter)
    plain.draft = None
    opt_a = make_optimizer(with_adapter, cfg, SPEC)
    opt_p = make_optimizer(plain, cfg)
    assert len(opt_a.param_groups) == 2 and opt_a.param_groups[1]["lr"] == SPEC.adapter_lr
    draft_before = {n: p.detach().clone() for n, p in with_adapter.draft.named_parameters()}
    accept = []
    for _ in range(8):
        m_a = Trainer(with_adapter, opt_a, cfg, SamplingConfig(), spec=SPEC).step(batch)
        m_p = Trainer(plain, opt_p, cfg, SamplingConfig()).step(batch)  # no draft loss
        accept.append(m_a[mn.SPEC_DRAFT_ACCEPTANCE])
        assert m_a[mn.LEARNER_GRAD_NORM] == m_p[mn.LEARNER_GRAD_NORM]
    policy_a = {n: p for n, p in with_adapter.state_dict().items() if not n.startswith("draft.")}
    for name, tensor in plain.state_dict().items():
        assert torch.equal(policy_a[name], tensor), name
    moved = [
        n for n, p in with_adapter.draft.named_parameters() if not torch.equal(p, draft_before[n])
    ]
    assert moved == [n for n, _ in with_adapter.draft.named_parameters()]
    assert accept[-1] > accept[0], accept  # the draft follows the policy more closely


def test_adapter_is_not_trained_without_spec_adapter():
    cfg = LearnerConfig(lr=1e-3)
    _, model, batch = _setup(adapter=True)
    opt = make_optimizer(model, cfg, SPEC)
    before = {n: p.detach().clone() for n, p in model.draft.named_parameters()}
    spec = SpecConfig(method="early_exit", exit_layer=1, aux_coef=0.5)  # adapter off
    metrics = Trainer(model, opt, cfg, SamplingConfig(), spec=spec).step(batch)
    assert mn.SPEC_DRAFT_ACCEPTANCE not in metrics
    assert all(torch.equal(p, before[n]) for n, p in model.draft.named_parameters())


def test_adapter_checkpoint_round_trip(tmp_path):
    cfg = LearnerConfig(lr=1e-3)
    tokenizer, model, batch = _setup(adapter=True)
    path, opt, loaded, opt2 = checkpoint_round_trip(tmp_path, tokenizer, model, batch, cfg, SPEC)
    assert (path / DRAFT_FILE).exists()
    assert loaded.draft is not None
    assert torch.equal(loaded.draft.vocab_ids, model.draft.vocab_ids)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert opt2.param_groups[1]["lr"] == SPEC.adapter_lr
    # The next step is the same from the original and from the resumed state.
    assert_next_step_matches(model, opt, loaded, opt2, batch, cfg, SPEC)

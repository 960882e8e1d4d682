"""A transformers model (Llama with Llama-3.1 RoPE scaling, Qwen2) trained by the learner: the
same update as the built-in model on the same weights, versions the actors' engine loads, and
checkpoints transformers opens."""

import copy
from pathlib import Path

import pytest
import torch
import transformers

from common.config.actor import SpecConfig
from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.model import Transformer
from common.policy_meta import model_args_from_meta, policy_meta
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.batch import collate
from learner.checkpoint import TrainerState, load_checkpoint, restore_optimizer, save_checkpoint
from learner.optim import make_optimizer
from learner.policy import load_policy, model_args
from learner.step import Trainer
from learner.versions import PolicyView
from testing.groups import make_groups
from testing.own_model import tiny_hf_config

TOKENIZER = CharTokenizer(BUILTIN_ALPHABET)
VOCAB = TOKENIZER.vocab_size
CPU = torch.device("cpu")
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}


def hf_dir(kind: str, tmp_path: Path) -> Path:
    torch.manual_seed(0)
    config = tiny_hf_config(
        kind,
        vocab_size=VOCAB,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=TOKENIZER.pad_id,
        **({"rope_scaling": dict(LLAMA3)} if kind == "llama" else {}),
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger than the init std, so logits (and the test) are not ~0
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    path = tmp_path / kind
    model.save_pretrained(path)
    TOKENIZER.save(path)
    return path


def sgd_delta(model, batch, cfg, spec=None):
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    Trainer(
        model, torch.optim.SGD(model.parameters(), lr=1.0), cfg, SamplingConfig(), spec=spec
    ).step(batch)
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_transformers_policy_trains_like_the_builtin_one(kind, tmp_path):
    path = hf_dir(kind, tmp_path)
    hf = load_policy(path, "hf", CPU)
    builtin = load_policy(path, "builtin", CPU)
    assert not isinstance(hf, Transformer) and isinstance(builtin, Transformer)
    assert load_policy(path, "auto", CPU).__class__ is Transformer
    batch = collate(make_groups(VOCAB, n=3, g=4), 0, TOKENIZER.pad_id, CPU)
    spec = SpecConfig(method="early_exit", exit_layer=1, aux_coef=0.5)
    cfg = LearnerConfig(
        grad_clip=0.0,
        max_tokens_per_microbatch=24,
        logprob_chunk_tokens=4,
        activation_checkpointing=True,
    )
    a, b = sgd_delta(hf, batch, cfg, spec), sgd_delta(builtin, batch, cfg, spec)
    assert set(a) == set(b)
    assert max(float((a[n] - b[n]).abs().max()) for n in a) < 2e-5
    assert max(float(v.abs().max()) for v in a.values()) > 1e-3  # the step did move weights


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_published_versions_load_in_the_actor_and_checkpoints_in_transformers(kind, tmp_path):
    path = hf_dir(kind, tmp_path)
    hf = load_policy(path, "hf", CPU)
    cfg = LearnerConfig(lr=1e-2, max_tokens_per_microbatch=32)
    optimizer = make_optimizer(hf, cfg)
    for step in range(3):
        batch = collate(make_groups(VOCAB, n=2, g=4, version=step), step, 0, CPU)
        metrics = Trainer(hf, optimizer, cfg, SamplingConfig()).step(batch)
        assert metrics["learner/skipped"] == 0.0
    # What the publisher sends: the view's args and state dict, with policy meta.
    view = PolicyView(hf, model_args(hf), None)
    meta = policy_meta(view.args, TOKENIZER)
    actor_model = Transformer(model_args_from_meta(meta))
    actor_model.load_state_dict(view.state_dict(), strict=True)
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    hf.eval()
    with torch.no_grad():
        expected = hf(ids).logits.float()
        torch.testing.assert_close(actor_model.eval()(ids), expected, atol=1e-4, rtol=1e-4)
    # A checkpoint opens in transformers as is, and resumes the HF policy with its optimizer.
    ckpt = save_checkpoint(tmp_path / "ckpt", hf, TOKENIZER, optimizer, TrainerState(3, 3))
    reopened = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        torch.testing.assert_close(reopened(ids).logits.float(), expected, atol=1e-5, rtol=1e-5)
    loaded, tensors, state, groups = load_checkpoint(ckpt, CPU, "hf")
    assert not isinstance(loaded, Transformer) and state.step == 3
    opt2 = make_optimizer(loaded, cfg)
    restore_optimizer(loaded, opt2, tensors, groups)
    assert len(opt2.state) == len(optimizer.state)


def test_other_layouts_publish_their_own_config_and_head_transforms_are_refused():
    """A layout the built-in model does not compute publishes its HF config (engine=vllm serves
    it); one whose logits are transformed after the LM head is refused before any training."""
    from common.model_args import HFLayout
    from testing.models import random_hf_model

    layout = model_args(random_hf_model("mistral", VOCAB))
    assert isinstance(layout, HFLayout) and layout.model_type == "mistral"
    assert layout.config["architectures"] == ["MistralForCausalLM"]
    assert layout.vocab_size == VOCAB
    softcapped = random_hf_model("gemma2", VOCAB, final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        model_args(softcapped)

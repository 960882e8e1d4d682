"""Versions of models the built-in transformer does not compute (Gemma 3, Mistral, Phi-3): what
their meta carries, what refuses them at start and why, the directory a vLLM actor writes from a
version (opened here by transformers), and a torch actor built from the published tensors
alone."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from actors.wiring import build_engine, write_published
from common.config import load_config
from common.model import load_pretrained
from common.model_args import HFLayout, ModelArgs, layout_from_hf_config
from common.policy_meta import (
    check_rollout_support,
    layout_from_meta,
    model_args_from_meta,
    policy_meta,
)
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from common.weights.fetch.reader import WeightReader
from common.weights.publish.writer import WeightWriter
from testing.models import FOREIGN_LAYOUTS, SMALL_SHAPE, random_hf_model, random_model

TOKENIZER = CharTokenizer(BUILTIN_ALPHABET)
VOCAB = 64
LAYOUTS = sorted(FOREIGN_LAYOUTS)


def layout_of(model: torch.nn.Module):
    """What the learner publishes of a transformers model (its config names its class once
    saved; a model made from a config gets it here)."""
    return layout_from_hf_config(
        {**model.config.to_dict(), "architectures": [type(model).__name__]}
    )


@pytest.mark.parametrize("model_type", LAYOUTS)
def test_a_foreign_layout_travels_in_the_meta_with_its_own_config(model_type):
    model = random_hf_model(model_type, VOCAB)
    layout = layout_of(model)
    assert isinstance(layout, HFLayout)
    assert f"model_type={model_type!r}" in layout.reason
    meta = policy_meta(layout, TOKENIZER)
    back = layout_from_meta(meta)
    assert isinstance(back, HFLayout) and back.model_type == model_type
    assert (back.vocab_size, back.num_hidden_layers, back.max_position_embeddings) == (
        VOCAB,
        2,
        256,
    )
    assert back.config["architectures"] == [type(model).__name__]
    assert back.config["hidden_size"] == 64 and back.config["torch_dtype"] == "float32"
    with pytest.raises(ValueError, match="unsupported model_type"):
        model_args_from_meta(meta)


def test_builtin_layouts_stay_builtin():
    args = random_model(VOCAB).args
    assert layout_from_hf_config(args.to_hf_config()) == args
    llama = transformers.LlamaConfig(**SMALL_SHAPE, vocab_size=VOCAB).to_dict()
    assert isinstance(layout_from_hf_config(llama), ModelArgs)
    # A Llama with a RoPE the built-in model lacks is still served, by vLLM.
    yarn = {**llama, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    yarn["architectures"] = ["LlamaForCausalLM"]
    assert isinstance(layout_from_hf_config(yarn), HFLayout)


def test_what_needs_the_builtin_layout_is_refused_with_the_reason():
    layout = layout_of(random_hf_model("gemma3_text", VOCAB))
    with pytest.raises(ValueError, match="engine=torch.*model_type='gemma3_text'.*engine=vllm"):
        check_rollout_support(layout, "torch", "none", False)
    for method, adapter in [("early_exit", False), ("hybrid", False), ("early_exit", True)]:
        with pytest.raises(ValueError, match=f"spec={method} drafts with the policy's own"):
            check_rollout_support(layout, "vllm", method, adapter)
    for method in ("none", "ngram"):
        check_rollout_support(layout, "vllm", method, False)
    check_rollout_support(random_model(VOCAB).args, "torch", "early_exit", True)


def test_configs_the_learner_would_train_wrongly_are_refused():
    base = {**SMALL_SHAPE, "vocab_size": VOCAB, "head_dim": 32}
    gemma2 = transformers.AutoConfig.for_model("gemma2", **base).to_dict()
    gemma2["architectures"] = ["Gemma2ForCausalLM"]
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        layout_from_hf_config(gemma2)
    granite = transformers.AutoConfig.for_model("granite", **base, logits_scaling=8.0).to_dict()
    granite["architectures"] = ["GraniteForCausalLM"]
    with pytest.raises(ValueError, match="logits_scaling=8.0"):
        layout_from_hf_config(granite)
    gemma3 = random_hf_model("gemma3_text", VOCAB).config.to_dict()
    with pytest.raises(ValueError, match="needs architectures"):
        layout_from_hf_config({**gemma3, "architectures": None})


@pytest.mark.parametrize("model_type", LAYOUTS)
def test_the_directory_a_vllm_actor_writes_opens_in_transformers(model_type, tmp_path):
    model = random_hf_model(model_type, VOCAB, seed=1)
    write_published(policy_meta(layout_of(model), TOKENIZER), model.state_dict(), tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in saved) == (not model.config.tie_word_embeddings)
    reopened = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(reopened(ids).logits, model(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_the_directory_a_vllm_actor_writes_of_the_builtin_model(tied, tmp_path):
    model = random_model(VOCAB, seed=2, tie_word_embeddings=tied)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    write_published(policy_meta(model.args, TOKENIZER), state, tmp_path)
    reopened = load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert reopened.args == model.args
    assert all(torch.equal(reopened.state_dict()[k], v) for k, v in state.items())


def publish(redis_client, state, meta) -> WeightReader:
    store = WeightWriter(redis_client, "layouts")
    store.publish(0, {k: v.clone() for k, v in state.items()}, meta)  # as the publisher copies
    return WeightReader.from_recipe(store.recipe())


def test_a_torch_actor_refuses_a_foreign_version_at_start(redis_client):
    model = random_hf_model("mistral", VOCAB)
    reader = publish(redis_client, model.state_dict(), policy_meta(layout_of(model), TOKENIZER))
    with pytest.raises(ValueError, match="model_type='mistral'.*use engine=vllm"):
        build_engine(reader, 0, load_config([]), seed=0)
    with pytest.raises(ValueError, match="spec=early_exit drafts with the policy's own"):
        build_engine(reader, 0, load_config(["engine=vllm", "spec=early_exit"]), seed=0)


def test_a_torch_actor_starts_from_the_published_tensors(redis_client):
    model = random_model(VOCAB, seed=4, tie_word_embeddings=True)
    reader = publish(redis_client, model.state_dict(), policy_meta(model.args, TOKENIZER))
    cfg = load_config([])
    torch.manual_seed(7)
    engine, _, layout = build_engine(reader, 0, cfg, seed=0)
    drawn = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(4)), "building the actor drew random weights"
    assert layout == model.args and engine.version == 0
    built = engine.model
    assert all(torch.equal(built.state_dict()[k], v) for k, v in model.state_dict().items())
    assert built.lm_head.weight is built.model.embed_tokens.weight  # tied, as published
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(built(ids), model(ids))
    engine.generate([[1, 5, 6]], 2, 4)  # it decodes
    bf16 = load_config(["engine.torch_dtype=bfloat16"])
    engine, _, _ = build_engine(reader, 0, bf16, seed=0)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}

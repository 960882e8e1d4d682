"""common/model.py and common/model_args.py: HF parity, KV-cache semantics (per-row positions, rollback), early exit, I/O."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from common.layers import KVCache
from common.model import Transformer, init_weights, load_pretrained, save_pretrained
from common.model_args import ModelArgs
from testing.models import random_model
from testing.shapes import shape

VOCAB = 64
HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def tiny_args(kind: str = "llama", tied: bool = False, layers: int = 3) -> ModelArgs:
    """A tiny model with head_dim 32 != hidden/heads and GQA, so shape mix-ups cannot cancel out."""
    return ModelArgs(
        **shape(VOCAB, 64, 128, layers, 4, 2),
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,  # non-default, so a reader that ignores it fails the parity test
        tie_word_embeddings=tied,
        attention_bias=kind == "qwen2",
        qk_norm=kind == "qwen3",
        eos_token_id=1,
    )


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Large random weights (norms and biases too): the default 0.02 init gives near-zero logits
    that would make a 1e-4 parity tolerance meaningless."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.15 * noise)


def make_model(kind: str = "llama", tied: bool = False, layers: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    model = Transformer(tiny_args(kind, tied, layers))
    randomize_(model, seed)
    return model.eval()


def hf_class(kind: str) -> type:
    cls = getattr(transformers, HF_CLASSES[kind], None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {HF_CLASSES[kind]}")
    return cls


def random_ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


# --- 1. parity with transformers, both directions ---------------------------------------------


@pytest.mark.parametrize(
    "kind,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", False)]
)
def test_logits_match_transformers_loading_our_checkpoint(kind: str, tied: bool, tmp_path: Path):
    model = make_model(kind, tied)
    save_pretrained(model, tmp_path)
    hf = hf_class(kind).from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    assert type(hf).__name__ == HF_CLASSES[kind]

    ids = random_ids(3, 11)  # [B, T]
    with torch.no_grad():
        ours = model(ids)  # [B, T, V]
        theirs = hf(ids).logits.float()
    assert ours.dtype == torch.float32 and ours.shape == (3, 11, VOCAB)
    assert ours.abs().max() > 0.5  # logits are not trivially small
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "kind,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", False)]
)
def test_logits_match_transformers_checkpoint_loaded_by_us(kind: str, tied: bool, tmp_path: Path):
    cls = hf_class(kind)
    config = transformers.AutoConfig.for_model(**tiny_args(kind, tied).to_hf_config())
    torch.manual_seed(0)
    hf = cls(config).eval()
    randomize_(hf, seed=5)
    hf.save_pretrained(tmp_path)

    model = load_pretrained(tmp_path)
    assert model.args == tiny_args(kind, tied)
    ids = random_ids(2, 9)  # [B, T]
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits.float(), atol=1e-4, rtol=0)


# --- 2-4. KV cache ----------------------------------------------------------------------------


@torch.no_grad()
def test_incremental_decoding_equals_full_forward():
    model = make_model("qwen3")
    ids = random_ids(2, 12)  # [B, T]
    full = model(ids)  # [B, T, V]

    prefill = 5
    cache = KVCache(model.args, batch_size=2, max_seq_len=16)
    steps = [model(ids[:, :prefill], cache=cache)]
    for t in range(prefill, ids.shape[1]):
        positions = torch.full((2, 1), t)
        steps.append(model(ids[:, t : t + 1], positions=positions, cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


@torch.no_grad()
def test_right_padded_rows_decode_like_each_row_alone():
    model = make_model("llama")
    lengths = [5, 3, 7]
    prompts = [random_ids(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    continuations = random_ids(3, 4, seed=20)  # [B, N] tokens each row feeds next
    B, T = len(lengths), max(lengths)
    padded = torch.zeros(B, T, dtype=torch.long)  # pad id 0, right-padded
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p

    cache = KVCache(model.args, batch_size=B, max_seq_len=16)
    prefill = model(padded, cache=cache)  # [B, T, V]
    batched = [[prefill[b, : lengths[b]]] for b in range(B)]
    for step in range(continuations.shape[1]):
        positions = torch.tensor([[n + step] for n in lengths])  # [B, 1] each row its own slot
        logits = model(continuations[:, step : step + 1], positions=positions, cache=cache)
        for b in range(B):
            batched[b].append(logits[b])

    for b in range(B):
        alone = model(torch.cat([prompts[b], continuations[b]])[None])[0]  # [T_b, V]
        torch.testing.assert_close(torch.cat(batched[b]), alone, atol=1e-5, rtol=0)


@torch.no_grad()
def test_rollback_by_decoding_from_an_earlier_position():
    model = make_model("qwen2")
    ids = random_ids(2, 10)  # [B, T]
    cache = KVCache(model.args, batch_size=2, max_seq_len=16)
    model(ids[:, :6], cache=cache)
    for t in range(6, 10):
        model(ids[:, t : t + 1], positions=torch.full((2, 1), t), cache=cache)

    # Each row rolls back to its own position and feeds a 3-token chunk (as a verifier would).
    rollback = [4, 7]
    new_tokens = random_ids(2, 3, seed=99)  # [B, 3]
    positions = torch.tensor([[j, j + 1, j + 2] for j in rollback])  # [B, 3]
    logits = model(new_tokens, positions=positions, cache=cache)  # [B, 3, V]

    for b, j in enumerate(rollback):
        fresh = model(torch.cat([ids[b, :j], new_tokens[b]])[None])[0]  # [j + 3, V]
        torch.testing.assert_close(logits[b], fresh[j:], atol=1e-5, rtol=0)


@torch.no_grad()
def test_explicit_positions_without_cache_mask_by_position():
    model = make_model("llama")
    ids = random_ids(1, 8)
    positions = torch.arange(8)[None]
    torch.testing.assert_close(model(ids, positions=positions), model(ids), atol=1e-5, rtol=0)


def test_cache_rejects_positions_outside_it():
    model = make_model("llama")
    cache = KVCache(model.args, batch_size=1, max_seq_len=4)
    with pytest.raises(ValueError, match=r"positions span \[0, 4\]"):
        model(random_ids(1, 5), cache=cache)
    with pytest.raises(ValueError, match="batch_size=1 != batch size 2"):
        model(random_ids(2, 2), cache=cache)


# --- 5. early exit and select_rows ------------------------------------------------------------


@torch.no_grad()
def test_num_layers_equals_a_model_cut_after_k_layers():
    model = make_model("qwen3", layers=4)
    k = 2
    # The reference: a k-layer model with the same embedding, first k layers, final norm, head.
    cut = Transformer(tiny_args("qwen3", layers=k)).eval()
    state = {
        name: t
        for name, t in model.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < k
    }
    cut.load_state_dict(state, strict=True)

    ids = random_ids(2, 7)
    early = model(ids, num_layers=k)
    torch.testing.assert_close(early, cut(ids), atol=1e-6, rtol=0)
    assert (early - model(ids)).abs().max() > 1e-2  # the cut really skips layers

    # With a cache, drafting writes only the first k layers and matches the no-cache draft.
    cache = KVCache(model.args, batch_size=2, max_seq_len=8)
    drafted = model(ids, cache=cache, num_layers=k)
    torch.testing.assert_close(drafted, early, atol=1e-5, rtol=0)
    assert cache.k[:k].abs().sum() > 0 and cache.k[k:].abs().sum() == 0

    with pytest.raises(ValueError, match="num_layers=5"):
        model(ids, num_layers=5)


@torch.no_grad()
def test_select_rows_keeps_the_chosen_rows():
    model = make_model("llama")
    ids = random_ids(3, 8)
    cache = KVCache(model.args, batch_size=3, max_seq_len=12)
    model(ids[:, :6], cache=cache)
    before_k, before_v = cache.k.clone(), cache.v.clone()

    keep = torch.tensor([2, 0])
    cache.select_rows(keep)
    assert cache.batch_size == 2 and cache.k.shape[1] == 2
    torch.testing.assert_close(cache.k, before_k[:, keep], atol=0, rtol=0)
    torch.testing.assert_close(cache.v, before_v[:, keep], atol=0, rtol=0)

    logits = model(ids[keep, 6:8], positions=torch.tensor([[6, 7], [6, 7]]), cache=cache)
    torch.testing.assert_close(logits, model(ids[keep])[:, 6:8], atol=1e-5, rtol=0)


# --- 6. save/load and config ------------------------------------------------------------------


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("qwen3", True)])
def test_save_load_round_trip(kind: str, tied: bool, tmp_path: Path):
    model = make_model(kind, tied)
    save_pretrained(model, tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in stored) is not tied

    loaded = load_pretrained(tmp_path)
    assert loaded.args == model.args
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, t in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], t, atol=0, rtol=0)
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = random_ids(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), atol=0, rtol=0)


def test_bf16_checkpoint_records_its_dtype(tmp_path: Path):
    model = make_model("llama").to(torch.bfloat16)
    save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert loaded(random_ids(1, 4)).dtype == torch.float32


def test_hf_config_names_the_architecture():
    assert tiny_args("llama").to_hf_config()["architectures"] == ["LlamaForCausalLM"]
    assert tiny_args("qwen2").to_hf_config()["architectures"] == ["Qwen2ForCausalLM"]
    assert tiny_args("qwen3").to_hf_config()["architectures"] == ["Qwen3ForCausalLM"]
    for kind in HF_CLASSES:
        args = tiny_args(kind)
        assert ModelArgs.from_hf_config(args.to_hf_config()) == args


@pytest.mark.parametrize(
    "override,match",
    [
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type='llama3'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type='yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ],
)
def test_from_hf_config_refuses_what_it_cannot_compute(override: dict, match: str):
    cfg = tiny_args("llama").to_hf_config() | override
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_hf_config(cfg)


def test_model_args_validation_quotes_values():
    with pytest.raises(ValueError, match="num_attention_heads=4 must be divisible by"):
        ModelArgs(64, 64, 128, 2, num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="hidden_size must be a positive int, got 0"):
        ModelArgs(64, 0, 128, 2, 4, 2)
    with pytest.raises(ValueError, match="eos_token_id=64 is outside"):
        ModelArgs(64, 64, 128, 2, 4, 2, eos_token_id=64)
    assert ModelArgs(64, 64, 128, 2, 4, 2).head_dim == 16


def test_init_is_deterministic():
    args = tiny_args("qwen2")
    torch.manual_seed(3)
    a = Transformer(args)
    torch.manual_seed(3)
    b = Transformer(args)
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name
    init_weights(a, seed=7)
    init_weights(b, seed=7)
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name


def test_split_layer_execution_equals_forward():
    # Early-exit drafting runs layers [0, E) and verification resumes at E: the split must be exact.
    model = random_model(32, intermediate_size=96, num_hidden_layers=4)
    ids = torch.randint(0, 32, (2, 7))
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
        h = model.run_layers(x, None, None, 0, 1)
        split = model.head(model.run_layers(h, None, None, 1, 4))
        torch.testing.assert_close(split, model(ids))
        torch.testing.assert_close(model.head(h), model(ids, num_layers=1))


def test_random_model_is_the_seeded_small_shape_with_overrides():
    a, b, c = random_model(151_936, 0), random_model(151_936, 0), random_model(151_936, 1)
    assert a.args.head_dim == 32 and a.args.num_hidden_layers == 2 and not a.training
    assert a.lm_head.weight.shape == (151_936, 64)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    wide = random_model(12, num_hidden_layers=3, intermediate_size=96, eos_token_id=2)
    assert (wide.args.num_hidden_layers, wide.args.intermediate_size) == (3, 96)
    assert wide.args.eos_token_id == 2

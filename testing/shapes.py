"""Model shapes for tests and benchmarks, as ``config.json`` fields: real models' (to build one
on the meta device, write its config or size a plan) and :func:`shape`, a small one in one line;
:func:`tensor_shapes`, a shape's tensors by their checkpoint names."""

from __future__ import annotations

from typing import Any


def shape(vocab: int, hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, **more: Any):
    """A Llama-style shape: vocabulary, hidden size, MLP width, layers, query and KV heads, and
    any other ``ModelArgs``/config field."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **more,
    )


SMOLLM2_135M = shape(
    49_152, 576, 1536, 30, 9, 3, head_dim=64, tie_word_embeddings=True,
    rope_theta=100_000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)  # fmt: skip
"""The ``smollm2-135m`` preset's shape (its config.json under runs/models/)."""

QWEN25_05B = shape(
    151_936, 896, 4864, 24, 14, 2, head_dim=64, tie_word_embeddings=True, attention_bias=True,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=32_768,
    eos_token_id=151_643, pad_token_id=151_643,
)  # fmt: skip
"""Qwen2.5-0.5B's shape (494M parameters)."""

QWEN25_7B = shape(
    152_064, 3584, 18_944, 28, 28, 4, max_position_embeddings=32_768, attention_bias=True
)
"""Qwen2.5-7B's shape as the built-in model describes it."""


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors of a Llama-style model of shape ``config`` (:func:`shape`'s fields) by their HF
    checkpoint names, in checkpoint order: q/k/v biases where ``attention_bias``, and no
    ``lm_head.weight`` where ``tie_word_embeddings``."""
    vocab, hidden, mlp = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[f"{p}self_attn.{name}_proj.weight"] = (rows, hidden)
            if config.get("attention_bias"):
                shapes[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        shapes |= {
            p + "self_attn.o_proj.weight": (hidden, q),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (mlp, hidden),
            p + "mlp.up_proj.weight": (mlp, hidden),
            p + "mlp.down_proj.weight": (hidden, mlp),
        }
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes

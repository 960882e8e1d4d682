"""``specrl plan``: memory per GPU of the learner and of an actor, estimated from an HF config.

Learner, per rank of an N-rank FSDP2 run (``learner.precision``):
- weights, gradients, AdamW moments: sharded over N. ``fp32`` and ``bf16-mixed`` keep fp32
  master weights, gradients and moments (4 + 4 + 8 bytes/parameter); ``bf16`` keeps all three in
  bf16 (2 + 2 + 4);
- FSDP working set (N > 1): the parameters gathered for compute, the root (embedding, LM head,
  final norm) plus two decoder layers (the one running and the one prefetched);
- activations for one micro-batch of ``max_tokens`` tokens: with activation checkpointing, each
  layer's input kept plus one layer's internals during its recompute; without, every layer's
  internals; plus the hidden states and the LM-head chunk (``chunk`` x vocab fp32 logits, their
  log-softmax and gradient).

Actor: weights in the serving dtype plus the KV cache (2 x layers x kv heads x head dim x bytes
x sequence length x concurrent sequences).

Estimates, not guarantees: allocator caching, CUDA context (~0.5-1 GiB), NCCL buffers and
fragmentation come on top. ``benchmarks/learner.py`` checks the estimate against CPU
measurements.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config.modes import PRECISIONS

GiB = 2**30


@dataclass
class Shape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Shape:
        heads = cfg["num_attention_heads"]
        return cls(
            vocab=cfg["vocab_size"],
            hidden=cfg["hidden_size"],
            intermediate=cfg["intermediate_size"],
            layers=cfg["num_hidden_layers"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
        )

    def layer_params(self) -> int:
        H, D = self.hidden, self.head_dim
        q, kv = self.heads * D, self.kv_heads * D
        attn = H * q + 2 * H * kv + q * H + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * H * self.intermediate + 2 * H

    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()

    def layer_activation_elems(self) -> int:
        """Elements one decoder layer keeps per token for backward (norm outputs, q/k/v,
        attention output, residuals, the SwiGLU's gate, up, activation and product)."""
        H, D = self.hidden, self.head_dim
        return 4 * H + (2 * self.heads + 2 * self.kv_heads) * D + 4 * self.intermediate


def learner_plan(
    shape: Shape,
    gpus: int = 1,
    precision: str = "bf16-mixed",
    max_tokens: int = 8192,
    chunk: int = 1024,
    checkpointing: bool = True,
) -> dict[str, float]:
    """Bytes per GPU of the learner (see the module docstring)."""
    master = 2 if precision == "bf16" else 4  # bytes/param of weights, gradients; x2 for AdamW
    compute = 2 if precision in ("bf16", "bf16-mixed") else 4  # bytes/element of activations
    P = shape.params()
    weights = P * master / gpus
    grads = P * master / gpus
    optimizer = 2 * P * master / gpus
    gathered = 0.0
    if gpus > 1:
        gathered = (shape.root_params() + 2 * shape.layer_params()) * master
    per_layer = shape.layer_activation_elems() * compute * max_tokens
    if checkpointing:
        activations = shape.layers * shape.hidden * compute * max_tokens + per_layer
    else:
        activations = shape.layers * per_layer
    hidden = 2 * max_tokens * shape.hidden * 4  # final hidden states and their gradient
    head = 3 * min(chunk or max_tokens, max_tokens) * shape.vocab * 4
    total = weights + grads + optimizer + gathered + activations + hidden + head
    return {
        "params": P,
        "weights": weights,
        "gradients": grads,
        "optimizer": optimizer,
        "fsdp_gathered": gathered,
        "activations": activations + hidden,
        "lm_head_chunk": head,
        "total": total,
    }


def actor_plan(
    shape: Shape, seq_len: int = 4096, sequences: int = 64, dtype_bytes: int = 2
) -> dict[str, float]:
    weights = shape.params() * dtype_bytes
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes * seq_len * sequences
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def _fmt(n: float) -> str:
    return f"{n / GiB:9.2f} GiB"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="specrl plan",
        description="Estimated memory per GPU of the learner and of an actor for an HF model.",
    )
    parser.add_argument("model", type=Path, help="a model directory or its config.json")
    parser.add_argument("--gpus", type=int, default=1, help="learner ranks (FSDP2)")
    parser.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    parser.add_argument(
        "--max-tokens", type=int, default=8192, help="learner.max_tokens_per_microbatch"
    )
    parser.add_argument("--chunk", type=int, default=1024, help="learner.logprob_chunk_tokens")
    parser.add_argument(
        "--no-checkpointing", action="store_true", help="learner.activation_checkpointing=false"
    )
    parser.add_argument("--actor-seq-len", type=int, default=4096, help="prompt + completion")
    parser.add_argument("--actor-sequences", type=int, default=64, help="concurrent sequences")
    parser.add_argument("--actor-dtype-bytes", type=int, default=2, help="2: bf16, 1: fp8")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    path = args.model / "config.json" if args.model.is_dir() else args.model
    shape = Shape.from_hf_config(json.loads(path.read_text()))
    learner = learner_plan(
        shape,
        args.gpus,
        args.precision,
        args.max_tokens,
        args.chunk,
        not args.no_checkpointing,
    )
    actor = actor_plan(shape, args.actor_seq_len, args.actor_sequences, args.actor_dtype_bytes)
    if args.json:
        print(json.dumps({"learner": learner, "actor": actor}, indent=2))
        return 0
    print(f"model: {path}  ({shape.params() / 1e9:.2f}B parameters)")
    print(
        f"learner per GPU ({args.gpus} GPU(s), {args.precision}, {args.max_tokens} tokens/"
        f"micro-batch, chunk {args.chunk}, checkpointing {not args.no_checkpointing}):"
    )
    for key in ("weights", "gradients", "optimizer", "fsdp_gathered", "activations"):
        print(f"  {key:<16}{_fmt(learner[key])}")
    print(f"  {'lm_head_chunk':<16}{_fmt(learner['lm_head_chunk'])}")
    print(f"  {'total':<16}{_fmt(learner['total'])}")
    print(
        f"actor per GPU ({args.actor_sequences} sequences x {args.actor_seq_len} tokens, "
        f"{args.actor_dtype_bytes}-byte weights and KV):"
    )
    for key in ("weights", "kv_cache", "total"):
        print(f"  {key:<16}{_fmt(actor[key])}")
    print("(estimates: add ~1 GiB for the CUDA context and allocator slack)")
    return 0

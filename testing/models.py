"""Small randomly initialised models for tests and benchmarks, and the reference log-probs of
given tokens."""

from __future__ import annotations

from typing import Any

import torch

from common.model import Transformer
from common.model_args import ModelArgs
from common.sampling import processed_logprobs

SMALL_SHAPE: dict[str, int] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)
"""The shape of :func:`random_model` unless overridden: 2 query heads of 32 channels (vLLM's CPU
attention needs a head_dim of at least 32), 1 KV head."""


def random_model(vocab_size: int, seed: int = 0, **fields: Any) -> Transformer:
    """A randomly initialised model in eval mode: :data:`SMALL_SHAPE` with any `ModelArgs` field
    overridden by ``fields``, its weights drawn after ``torch.manual_seed(seed)``. Tests and
    benchmarks use it to run the real-model code paths on a CPU, at a tiny vocabulary that can be
    enumerated or at a real one (e.g. Qwen's 151,936)."""
    args = ModelArgs(vocab_size=vocab_size, **{**SMALL_SHAPE, **fields})
    torch.manual_seed(seed)
    return Transformer(args).eval()


FOREIGN_LAYOUTS: dict[str, dict[str, Any]] = {
    "gemma3_text": dict(
        query_pre_attn_scalar=32,
        # Both attention kinds, the window longer than any test sequence.
        sliding_window=512,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "mistral": dict(sliding_window=None, tie_word_embeddings=False),
    "phi3": dict(tie_word_embeddings=False),
}
"""``transformers`` layouts the built-in model does not compute but vLLM 0.32 serves natively,
with what :func:`random_hf_model` sets beyond :data:`SMALL_SHAPE` (Gemma 3 ties its LM head)."""


def random_hf_model(
    model_type: str, vocab_size: int, seed: int = 0, std: float = 0.1, **fields: Any
) -> torch.nn.Module:
    """A randomly initialised ``transformers`` causal LM of ``model_type`` in eval mode:
    :data:`SMALL_SHAPE` (head_dim 32, BOS 1, EOS 2, pad 0, context 256), the layout's settings in
    :data:`FOREIGN_LAYOUTS` and ``fields``; matrices drawn from N(0, ``std``) after
    ``torch.manual_seed(seed)`` (above the init std, so its distributions are not near uniform)."""
    import transformers

    config = transformers.AutoConfig.for_model(
        model_type,
        **{
            **SMALL_SHAPE,
            "vocab_size": vocab_size,
            "head_dim": 32,
            "max_position_embeddings": 256,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            **FOREIGN_LAYOUTS.get(model_type, {}),
            **fields,
        },
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    return model.eval()


def tiny_model(vocab: int) -> Transformer:
    """:func:`random_model` (seed 0) in train mode, for tests of the learner's step."""
    return random_model(vocab).train()


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """Processed log-prob of given tokens: logits [B, T, V], tokens [B, T] -> [B, T]."""
    return (
        processed_logprobs(logits, temperature, top_p).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    )

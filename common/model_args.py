"""The architecture a published version carries: :class:`ModelArgs`, the shape and numerics of
the built-in transformer, read from and written to a Hugging Face ``config.json`` (llama, qwen2
and qwen3 layouts; static RoPE scaling types only), or :class:`HFLayout`, any other
``transformers`` causal LM, described by its own ``config.json``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

import torch
from torch import Tensor

# Init std for Linear/Embedding weights; the HF default `initializer_range`.
INIT_STD = 0.02

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class ModelArgs:
    """Shape and numerics of the transformer; field names follow HF `config.json`."""

    vocab_size: int
    """Number of token ids; rows of the embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """Key/value heads per layer (GQA); must divide `num_attention_heads`."""
    head_dim: int | None = None
    """Per-head width; None means `hidden_size // num_attention_heads` (filled in post-init)."""
    max_position_embeddings: int = 2048
    """Context length the checkpoint advertises; recorded in config.json, not enforced."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix (no `lm_head.weight` in the checkpoint)."""
    attention_bias: bool = False
    """Qwen2-style bias on q/k/v projections (o_proj has none)."""
    qk_norm: bool = False
    """Qwen3-style per-head RMSNorm on q and k before RoPE."""
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    """End-of-sequence id; the first one when the HF config lists several."""
    pad_token_id: int | None = None
    draft_exit_layer: int = 0
    """The trained self-draft's exit: its adapter reads the residual stream after this many
    layers (``Transformer.draft``); 0 = the model has no adapter."""
    draft_vocab_size: int = 0
    """Token ids the adapter drafts over (its reduced vocabulary); 0 = all of them."""
    eagle_aux_layers: tuple[int, ...] = ()
    """The EAGLE-3 draft head's inputs (``Transformer.eagle``, common/eagle.py): the residual
    stream after each of these many layers (0 = the embeddings; vLLM's
    ``eagle_aux_hidden_state_layer_ids``), sorted, unique; empty = the model has no head."""
    eagle_vocab_size: int = 0
    """Token ids the EAGLE-3 head drafts over (its reduced vocabulary, mapped by ``eagle.d2t``);
    0 = all of them."""
    rope_scaling: dict[str, Any] | None = None
    """Static RoPE frequency scaling, HF spelling without `rope_theta`: ``{"rope_type": "linear",
    "factor": f}`` or ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}`` (Llama-3.1 and later). None: default RoPE."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"head_dim is unset and hidden_size={self.hidden_size} is not divisible by "
                    f"num_attention_heads={self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2 != 0:
            # RoPE rotates pairs of channels, so the head width must be even.
            raise ValueError(f"head_dim must be a positive even int, got {self.head_dim!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not 0 <= self.draft_exit_layer < self.num_hidden_layers:
            raise ValueError(
                f"draft_exit_layer={self.draft_exit_layer} must be in [0, "
                f"{self.num_hidden_layers - 1}] (0: no adapter)"
            )
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must be in [0, {self.vocab_size}]"
            )
        self.eagle_aux_layers = tuple(int(i) for i in self.eagle_aux_layers)
        if list(self.eagle_aux_layers) != sorted(set(self.eagle_aux_layers)) or any(
            not 0 <= i <= self.num_hidden_layers for i in self.eagle_aux_layers
        ):
            raise ValueError(
                f"eagle_aux_layers={list(self.eagle_aux_layers)} must be sorted unique layer "
                f"counts in [0, {self.num_hidden_layers}]"
            )
        if not 0 <= self.eagle_vocab_size <= self.vocab_size or (
            self.eagle_vocab_size and not self.eagle_aux_layers
        ):
            raise ValueError(
                f"eagle_vocab_size={self.eagle_vocab_size} must be in [0, {self.vocab_size}] and "
                "needs eagle_aux_layers"
            )
        if self.attention_bias and self.qk_norm:
            # No HF architecture matches: Qwen3's `attention_bias` also puts a bias on o_proj.
            raise ValueError(
                f"attention_bias={self.attention_bias} with qk_norm={self.qk_norm} is not a "
                "supported architecture (Qwen2 has q/k/v bias, Qwen3 has qk_norm; not both)"
            )
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")
        if self.rope_scaling is not None:
            self.rope_scaling = _check_rope_scaling(self.rope_scaling)

    @property
    def cache_layers(self) -> int:
        """Layers a KV cache holds: the decoder layers, plus the draft adapter's and the EAGLE-3
        head's, each if any (in that order)."""
        return self.num_hidden_layers + (1 if self.draft_exit_layer else 0) + self.has_eagle

    @property
    def has_eagle(self) -> bool:
        """The model carries an EAGLE-3 draft head (``eagle_aux_layers`` set)."""
        return bool(self.eagle_aux_layers)

    @property
    def eagle_cache_layer(self) -> int:
        """The KV cache layer of the EAGLE-3 head's decoder layer (after the adapter's)."""
        if not self.has_eagle:
            raise ValueError("this model has no EAGLE-3 head (ModelArgs.eagle_aux_layers empty)")
        return self.num_hidden_layers + (1 if self.draft_exit_layer else 0)

    @property
    def model_type(self) -> str:
        """HF `model_type` of the checkpoint this model writes."""
        if self.qk_norm:
            return "qwen3"
        if self.attention_bias:
            return "qwen2"
        return "llama"

    def to_hf_config(self, torch_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """The `config.json` content that `transformers` and vLLM read back as this model.

        `torch_dtype` names the dtype of the saved tensors.
        """
        cfg: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: transformers 5 reads `rope_parameters`, older readers `rope_theta`.
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": {
                **(self.rope_scaling or {"rope_type": "default"}),
                "rope_theta": self.rope_theta,
            },
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "initializer_range": INIT_STD,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": _DTYPE_NAMES[torch_dtype],
        }
        if self.draft_exit_layer:
            # Extra keys that transformers and vLLM ignore; the adapter's tensors live in their
            # own file (DRAFT_FILE), so model.safetensors stays a plain checkpoint.
            cfg.update(
                draft_exit_layer=self.draft_exit_layer, draft_vocab_size=self.draft_vocab_size
            )
        if self.has_eagle:
            # Extra keys too; the head's tensors live in EAGLE_FILE (common/model.py).
            cfg.update(
                eagle_aux_layers=list(self.eagle_aux_layers),
                eagle_vocab_size=self.eagle_vocab_size,
            )
        if self.model_type == "llama":
            cfg.update(attention_bias=False, mlp_bias=False)
        else:
            cfg.update(
                use_sliding_window=False,
                sliding_window=None,
                max_window_layers=self.num_hidden_layers,
            )
            if self.model_type == "qwen3":
                cfg["attention_bias"] = False
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Read a llama/qwen2/qwen3 `config.json`; refuse anything this model would compute wrongly."""
        model_type = cfg.get("model_type")
        if model_type not in _ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type={model_type!r}; supported: {sorted(_ARCHITECTURES)}"
            )
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act={hidden_act!r}; only 'silu' (SwiGLU)")
        if cfg.get("mlp_bias", False):
            raise ValueError(f"unsupported mlp_bias={cfg['mlp_bias']!r}")
        # Llama's and Qwen3's `attention_bias` also biases o_proj, which this model lacks.
        if model_type in ("llama", "qwen3") and cfg.get("attention_bias", False):
            raise ValueError(
                f"unsupported attention_bias={cfg['attention_bias']!r} for {model_type} "
                "(it biases o_proj too)"
            )
        if cfg.get("use_sliding_window", False):
            raise ValueError("unsupported use_sliding_window=True; only full attention")
        layer_types = cfg.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise ValueError(f"unsupported layer_types={sorted(set(layer_types))}")
        rope_theta, rope_scaling = _rope_spec(cfg)

        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        derived = {
            "num_key_value_heads": cfg.get("num_key_value_heads") or num_heads,
            "rope_theta": rope_theta,
            # Qwen2 always has q/k/v bias; it has no config switch for it.
            "attention_bias": model_type == "qwen2",
            "qk_norm": model_type == "qwen3",
            "eos_token_id": eos,
            "rope_scaling": rope_scaling,
        }
        # The other fields carry their config.json names: a required one must be there, a
        # missing optional one keeps its default (the HF default too).
        same_name = {
            f.name: cfg[f.name] if f.default is MISSING else cfg.get(f.name, f.default)
            for f in fields(cls)
            if f.name not in derived
        }
        return cls(**same_name, **derived)


def default_eagle_aux_layers(num_hidden_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 inputs, (2, L // 2, L - 3) after L layers, kept inside [0, L],
    sorted and deduplicated as vLLM does."""
    L = num_hidden_layers
    return tuple(sorted({min(max(i, 0), L) for i in (2, L // 2, L - 3)}))


_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _check_rope_scaling(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Normalised static RoPE scaling (None for default); refuses types computed differently."""
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in _ROPE_KEYS:
        raise ValueError(
            f"unsupported rope_type={rope_type!r}; supported: 'default', {sorted(_ROPE_KEYS)} "
            "(dynamic, yarn and longrope RoPE are not implemented)"
        )
    if spec.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor={spec['partial_rotary_factor']!r}")
    missing = [k for k in _ROPE_KEYS[rope_type] if k not in spec]
    if missing:
        raise ValueError(f"rope_type={rope_type!r} needs {missing}")
    out: dict[str, Any] = {"rope_type": rope_type}
    for k in _ROPE_KEYS[rope_type]:
        out[k] = spec[k] if k == "original_max_position_embeddings" else float(spec[k])
    if not out["factor"] > 0:
        raise ValueError(f"RoPE factor must be > 0, got {out['factor']}")
    return out


def _rope_spec(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and static scaling from either config spelling (`rope_parameters` first)."""
    params = cfg.get("rope_parameters")
    # Both spellings are checked; the first present wins.
    checked = [_check_rope_scaling(s) for s in (params, cfg.get("rope_scaling")) if s is not None]
    found = checked[0] if checked else None
    if params is not None and "rope_theta" in params:
        return float(params["rope_theta"]), found
    return float(cfg.get("rope_theta", 10000.0)), found


# Logit transforms that a transformers model applies after its LM head. The learner computes
# log-probs from ``lm_head`` alone (learner/microbatch.py), so a model that sets one would be
# trained on other log-probs than the actors sample from.
_HEAD_TRANSFORMS = {
    "final_logit_softcapping": None,  # Gemma 2 (Gemma 3 when set)
    "logit_scale": 1.0,  # Cohere
    "logits_scaling": 1.0,  # Granite
}
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass
class HFLayout:
    """A ``transformers`` causal LM whose layout the built-in model does not compute (Gemma 3,
    Mistral, Phi-3, OLMo 2, ...): versions carry its own ``config.json`` and its HF parameter
    names. ``engine=vllm`` serves it (any architecture the installed vLLM supports); the torch
    engine, the early exit and the trained self-draft need :class:`ModelArgs`."""

    config: dict[str, Any]
    """The model's ``config.json`` content."""
    reason: str = ""
    """Why :meth:`ModelArgs.from_hf_config` refused it (what the torch engine reports)."""

    def __post_init__(self) -> None:
        cfg = self.config
        for key in ("vocab_size", "num_hidden_layers"):
            value = cfg.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config.json needs a positive int {key}, got {value!r}")
        if not isinstance(cfg.get("model_type"), str) or not cfg["model_type"]:
            raise ValueError("config.json has no model_type")
        arch = cfg.get("architectures")
        if not (isinstance(arch, list) and arch and all(isinstance(a, str) for a in arch)):
            raise ValueError(
                f"config.json needs architectures (the model class vLLM serves), got {arch!r}"
            )
        if self.max_position_embeddings <= 0:
            raise ValueError(f"config.json gives no context length (one of {_CONTEXT_KEYS})")
        for key, neutral in _HEAD_TRANSFORMS.items():
            value = cfg.get(key, neutral)
            if value is not None and value != neutral:
                raise ValueError(
                    f"unsupported {key}={value!r} ({cfg['model_type']}): the learner computes "
                    "log-probs from the LM head alone, so the actors would sample from another "
                    "distribution than the one trained"
                )

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def num_hidden_layers(self) -> int:
        return self.config["num_hidden_layers"]

    @property
    def max_position_embeddings(self) -> int:
        """The context the checkpoint advertises (the first of the usual keys present)."""
        for key in _CONTEXT_KEYS:
            value = self.config.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return 0

    def to_hf_config(self, torch_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """The model's ``config.json`` with the dtype of the saved tensors (both spellings)."""
        cfg = dict(self.config)
        cfg["torch_dtype"] = cfg["dtype"] = _DTYPE_NAMES[torch_dtype]
        return cfg


Layout = ModelArgs | HFLayout
"""What actors build the policy from: the built-in model's arguments, or a foreign HF layout."""


def layout_from_hf_config(cfg: dict[str, Any]) -> Layout:
    """:class:`ModelArgs` when the built-in model computes this ``config.json`` exactly, else an
    :class:`HFLayout` (which refuses configs that the learner would train wrongly)."""
    try:
        return ModelArgs.from_hf_config(cfg)
    except (ValueError, KeyError, TypeError) as e:
        return HFLayout(dict(cfg), reason=str(e))


TIED_HEAD = "lm_head.weight"
"""The LM head's tensor, left out of a published version where it is the embedding."""
EMBEDDING = "model.embed_tokens.weight"


def head_is_tied(args: Layout) -> bool:
    """Whether the built-in model's LM head is its embedding (``tie_word_embeddings``)."""
    return isinstance(args, ModelArgs) and args.tie_word_embeddings


def config_ties_head(config: Mapping[str, Any]) -> bool:
    """Whether a ``config.json`` dict ties the LM head to the embedding: its
    ``tie_word_embeddings``, False when absent, as :meth:`ModelArgs.from_hf_config` reads it (so
    for the built-in model it agrees with :func:`head_is_tied`)."""
    return bool(config.get("tie_word_embeddings", False))


def without_tied_head(state: Mapping[str, Tensor], args: Layout) -> dict[str, Tensor]:
    """``state`` as published: a tied LM head is left out, as HF checkpoints leave it, so every
    copy of a version (snapshot slots, Redis, the actors' buffers) holds the matrix once."""
    tied = head_is_tied(args)
    return {name: t for name, t in state.items() if not (tied and name == TIED_HEAD)}


def with_tied_head(state: Mapping[str, Tensor], args: Layout) -> dict[str, Tensor]:
    """A published ``state`` as the model loads it: a tied LM head is the embedding tensor
    itself (the same storage, not a copy)."""
    out = dict(state)
    if head_is_tied(args) and EMBEDDING in out:
        out[TIED_HEAD] = out[EMBEDDING]
    return out

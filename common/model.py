"""Llama/Qwen2/Qwen3-compatible decoder-only transformer in plain PyTorch, with HF-format I/O.

The torch engine (actors) and the learner both run this model. Parameter names equal the Hugging
Face names exactly, so a `state_dict` maps 1:1 onto a `config.json + model.safetensors` checkpoint
that `transformers` and vLLM open directly, and onto the weight chunks published through Redis.

Architecture: pre-norm decoder layers (RMSNorm), rotary position embeddings (HF `rotate_half`
convention; rope types `default`, `linear` and `llama3`, the static ones whose frequencies do not
depend on the sequence length), grouped-query attention, SwiGLU MLP. Two switches cover the
Qwen families: `attention_bias` (Qwen2: bias on q/k/v, none on o) and `qk_norm` (Qwen3: per-head
RMSNorm on q and k before RoPE).

KV cache semantics (`KVCache`): a forward with a cache first WRITES the k/v of its tokens at their
per-row `positions`, then each query at position p attends to cache slots j <= p. Causality is by
slot index, never by a stored length, which gives two properties the rollout side relies on:
- right-padded prompts of different lengths share one batch: a pad entry sits at a slot that the
  row's next real token overwrites before any query of that row can attend to it;
- truncation is free: to roll a row back to position j, decode again from j; stale entries past
  the query are masked and get overwritten.
A cache is any object with ``attention_mask(positions, dtype)`` (validate, and the mask over the
slots each query may see) and ``update(layer, k, v, positions, width)`` (write, then return the
k/v of those slots); `KVCache` is the contiguous one, the torch engine's block pool another.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

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
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """Key/value heads per layer (GQA); must divide `num_attention_heads`."""
    head_dim: int | None = None
    """Per-head width; None means `hidden_size // num_attention_heads` (filled in post-init)."""
    max_position_embeddings: int = 2048
    """Context length the checkpoint advertises; recorded in config.json, not enforced."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix (no `lm_head.weight` in the checkpoint)."""
    attention_bias: bool = False
    """Qwen2-style bias on q/k/v projections (o_proj has none)."""
    qk_norm: bool = False
    """Qwen3-style per-head RMSNorm on q and k before RoPE."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id, if the tokenizer has one."""
    eos_token_id: int | None = None
    """End-of-sequence id; the first one when the HF config lists several."""
    pad_token_id: int | None = None
    """Padding id, if any."""
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
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim"),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v bias; it has no config switch for it.
            attention_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=cfg.get("pad_token_id"),
            rope_scaling=rope_scaling,
        )


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
    scaling = cfg.get("rope_scaling")
    params = cfg.get("rope_parameters")
    found = None
    for spec in (params, scaling):
        if spec is None:
            continue
        checked = _check_rope_scaling(spec)
        if found is None:
            found = checked
    if params is not None and "rope_theta" in params:
        return float(params["rope_theta"]), found
    return float(cfg.get("rope_theta", 10000.0)), found


class KVCache:
    """Batched KV cache indexed by per-row positions: k/v tensors [L, B, H_kv, S_max, D].

    A forward writes each token's k/v at slot `positions[b, t]` of row b, then attends to slots
    j <= query position; see the module docstring for why that makes padding and rollback free.
    """

    def __init__(
        self,
        args: ModelArgs,
        batch_size: int,
        max_seq_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if batch_size <= 0 or max_seq_len <= 0:
            raise ValueError(
                f"KVCache needs batch_size > 0 and max_seq_len > 0, got {batch_size}, {max_seq_len}"
            )
        shape = (
            args.num_hidden_layers,
            batch_size,
            args.num_key_value_heads,
            max_seq_len,
            args.head_dim,
        )
        dtype = dtype or torch.get_default_dtype()
        self.k: Tensor = torch.zeros(shape, device=device, dtype=dtype)  # [L, B, H_kv, S_max, D]
        self.v: Tensor = torch.zeros(shape, device=device, dtype=dtype)  # [L, B, H_kv, S_max, D]
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len

    def append_rows(self, other: KVCache) -> None:
        """Add ``other``'s rows after ours (same layers, heads and length), e.g. when rows that
        were verified on their own rejoin the decoding batch."""
        if other.k.shape[0] != self.k.shape[0] or other.k.shape[2:] != self.k.shape[2:]:
            raise ValueError(
                f"cannot append a cache of shape {tuple(other.k.shape)} to {tuple(self.k.shape)}"
            )
        self.k = torch.cat([self.k, other.k], dim=1)
        self.v = torch.cat([self.v, other.v], dim=1)
        self.batch_size += other.batch_size

    def select_rows(self, idx: Tensor) -> None:
        """Keep only rows `idx` (in that order), e.g. when finished rows leave the batch."""
        idx = idx.to(device=self.k.device, dtype=torch.long)  # [B']
        self.k = self.k.index_select(1, idx)
        self.v = self.v.index_select(1, idx)
        self.batch_size = int(idx.numel())

    def attention_mask(self, positions: Tensor, dtype: torch.dtype) -> Tensor:
        """Bool mask [B, 1, T, S] over cache slots, S = max(positions) + 1; validates the cache."""
        B = positions.shape[0]
        if self.batch_size != B:
            raise ValueError(f"cache.batch_size={self.batch_size} != batch size {B}")
        if self.k.dtype != dtype or self.k.device != positions.device:
            raise ValueError(
                f"cache is {self.k.dtype} on {self.k.device}, model runs {dtype} on "
                f"{positions.device}"
            )
        # One host sync per forward: the attended width must be a Python int.
        lo, hi = torch.stack([positions.min(), positions.max()]).tolist()
        if lo < 0 or hi >= self.max_seq_len:
            raise ValueError(
                f"positions span [{lo}, {hi}], outside the cache [0, {self.max_seq_len})"
            )
        slots = torch.arange(hi + 1, device=positions.device)  # [S]
        return (slots <= positions[..., None])[:, None]  # [B, 1, T, S]

    def update(
        self, layer: int, k: Tensor, v: Tensor, positions: Tensor, width: int
    ) -> tuple[Tensor, Tensor]:
        """Write k/v [B, H_kv, T, D] at `positions` [B, T] of `layer`; return its first `width`
        slots [B, H_kv, S, D] (write first, then attend: a chunk's queries see their own keys)."""
        B, H, T, D = k.shape
        idx = positions[:, None, :, None].expand(B, H, T, D)
        self.k[layer].scatter_(2, idx, k)
        self.v[layer].scatter_(2, idx, v)
        return self.k[layer, :, :, :width], self.v[layer, :, :, :width]


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, exactly as HF Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Inverse frequencies [D/2] in fp32, as `transformers`' `ROPE_INIT_FUNCTIONS` compute them for
    the default, `linear` and `llama3` rope types (all three have attention factor 1)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    )  # [D/2]
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions: Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    scaling: dict[str, Any] | None = None,
) -> tuple[Tensor, Tensor]:
    """cos/sin tables [B, 1, T, D] for `positions` [B, T], HF rope convention.

    Angles are computed in fp32 (low-precision angles at large positions drift visibly), and the
    half-width frequencies are concatenated twice to pair with `rotate_half`.
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling, positions.device)  # [D/2]
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, H, T, D] by the angles in cos/sin [B, 1, T, D] (HF `rotate_half` layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """GQA self-attention; optional q/k/v bias (Qwen2) and per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.head_dim is not None  # filled in by ModelArgs.__post_init__
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_dim, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_dim, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(q_dim, args.hidden_size, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: Tensor,  # [B, T, H]
        cos: Tensor,  # [B, 1, T, D]
        sin: Tensor,  # [B, 1, T, D]
        mask: Tensor | None,  # [B, 1, T, S] bool, True = attend; None = plain causal over T
        kv: tuple[Any, int, Tensor] | None,
    ) -> Tensor:
        """kv: the cache, this layer's index in it and the positions [B, T] to write."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H_q, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, H_kv, T, D]
        v = v.transpose(1, 2)  # [B, H_kv, T, D]

        if kv is not None:
            cache, layer, positions = kv
            # Write first, then attend: the queries of this chunk must see their own keys. Width
            # max(positions) + 1: slots beyond it are masked for every query.
            k, v = cache.update(layer, k, v, positions, mask.shape[-1])  # [B, H_kv, S, D]

        # Repeating kv heads (rather than enable_gqa) keeps every SDPA backend, incl. masked ones,
        # available; HF's repeat_kv uses the same interleaved head order.
        rep = self.num_heads // self.num_kv_heads
        if rep > 1 and kv is not None and mask is not None:
            # Over the cache (decoding): the `rep` query heads of each kv head attend as one
            # longer query block instead of repeating the cached k/v `rep` times; query head h
            # still reads kv head h // rep, the pairing of repeat_interleave below.
            S = k.shape[2]
            q = q.reshape(B, self.num_kv_heads, rep * T, self.head_dim)
            mask = mask.expand(B, 1, T, S).repeat(1, 1, rep, 1)  # [B, 1, rep * T, S]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out = out.view(B, self.num_heads, T, self.head_dim)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        kv: tuple[Any, int, Tensor] | None,
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """The `model.` prefix of HF names: embedding, decoder layers, final norm."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    """Decoder-only LM whose `state_dict` keys equal the HF `*ForCausalLM` keys.

    Initialisation is deterministic given `torch.manual_seed` (see `init_weights`): the
    constructor draws all weights from the global torch RNG in a fixed order.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderStack(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.gradient_checkpointing = False
        """Recompute each decoder layer in backward instead of keeping its activations (training)."""
        self.tie_weights()
        init_weights(self)

    def tie_weights(self) -> None:
        """Make the LM head share the embedding Parameter when `tie_word_embeddings`."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        num_layers: int | None = None,
    ) -> Tensor:
        """Final-normed hidden states [B, T, H]; arguments as in `forward`."""
        L = self.args.num_hidden_layers
        num_layers = L if num_layers is None else num_layers
        if not 1 <= num_layers <= L:
            raise ValueError(f"num_layers={num_layers} must be in [1, {L}]")
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        return self.model.norm(self.run_layers(x, positions, cache, 0, num_layers))

    def run_layers(
        self,
        x: Tensor,
        positions: Tensor | None,
        cache: KVCache | None,
        start: int,
        end: int,
    ) -> Tensor:
        """Decoder layers ``[start, end)`` on the residual stream x [B, T, H] (before the final norm).

        Split execution is what early-exit drafting needs: the draft runs layers [0, E) and stops;
        verification resumes the same hidden states at layer E instead of recomputing them.
        """
        B, T, _ = x.shape
        if not 0 <= start <= end <= self.args.num_hidden_layers:
            raise ValueError(
                f"layer range [{start}, {end}) outside [0, {self.args.num_hidden_layers}]"
            )
        if positions is not None and tuple(positions.shape) != (B, T):
            raise ValueError(f"positions shape {tuple(positions.shape)} != {(B, T)}")
        default_positions = positions is None
        if positions is None:
            positions = torch.arange(T, device=x.device).expand(B, T)
        positions = positions.to(torch.long)  # [B, T]
        if cache is not None:
            mask = cache.attention_mask(positions, x.dtype)  # [B, 1, T, S]
        elif default_positions:
            # A plain causal prefix: passing no mask lets SDPA pick a fused causal kernel.
            mask = None
        else:
            mask = positions[:, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, T]
        cos, sin = rope_cos_sin(
            positions, self.args.head_dim, self.args.rope_theta, x.dtype, self.args.rope_scaling
        )
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i in range(start, end):
            kv = (cache, i, positions) if cache is not None else None
            if recompute and cache is None:
                # Activation checkpointing: keep each layer's input, recompute inside in backward.
                x = checkpoint(self.model.layers[i], x, cos, sin, mask, None, use_reentrant=False)
            else:
                x = self.model.layers[i](x, cos, sin, mask, kv)
        return x

    def head(self, x: Tensor) -> Tensor:
        """Final norm + LM head on the residual stream: [B, T, H] -> logits [B, T, V] float32."""
        return self.lm_head(self.model.norm(x)).float()

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        num_layers: int | None = None,
    ) -> Tensor:
        """Logits [B, T, V] float32 for `input_ids` [B, T] int64.

        positions: [B, T] int64, default `arange(T)` per row; used for RoPE and for the mask
            (a key is visible to a query iff key position <= query position).
        cache: when given, k/v of these tokens are written at `positions` first, then each query
            attends to cache slots j <= its position (only the first max(positions)+1 slots).
        num_layers: run only the first `num_layers` decoder layers, then the final norm and the
            LM head (early-exit drafting, LayerSkip style); with a cache only those layers' slots
            are written.
        """
        return self.lm_head(self.hidden_states(input_ids, positions, cache, num_layers)).float()


def init_weights(model: Transformer, seed: int | None = None) -> None:
    """Re-initialise `model` in place: N(0, INIT_STD) for Linear/Embedding weights, zero biases,
    unit norm weights. With `seed`, the draw uses a private generator (global RNG untouched);
    without, it uses the global torch RNG, so `torch.manual_seed` makes it deterministic.
    """
    generator = None
    if seed is not None:
        generator = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                if module is model.lm_head and model.args.tie_word_embeddings:
                    continue  # shared with the embedding, drawn once there
                module.weight.normal_(0.0, INIT_STD, generator=generator)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)


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


def save_pretrained(model: Transformer, path: str | Path) -> None:
    """Write `config.json` + `model.safetensors` (HF layout) into `path`, creating it.

    Tensors keep the model's dtype (recorded as `torch_dtype`); a tied LM head is omitted, as HF
    does, since safetensors refuses shared storage.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {
        name: t.detach().contiguous().cpu()
        for name, t in model.state_dict().items()
        if not (model.args.tie_word_embeddings and name == "lm_head.weight")
    }
    dtype = model.lm_head.weight.dtype
    (path / CONFIG_FILE).write_text(json.dumps(model.args.to_hf_config(dtype), indent=2) + "\n")
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})


def load_pretrained(
    path: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """Load an HF llama/qwen2/qwen3 checkpoint directory (single or sharded safetensors)."""
    path = Path(path)
    args = ModelArgs.from_hf_config(json.loads((path / CONFIG_FILE).read_text()))
    state = _read_safetensors(path)
    # Old Llama checkpoints carry RoPE tables; this model recomputes them from rope_theta.
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if args.tie_word_embeddings:
        # Some tied checkpoints still store the head; the embedding is the one source of truth.
        state.pop("lm_head.weight", None)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    if args.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]

    # Build on the meta device so no memory or time goes into weights about to be replaced.
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(state, strict=True, assign=True)
    # assign=True gives each key its own Parameter; restore the single shared one.
    model.tie_weights()
    return model


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    """All tensors of `model.safetensors`, or of every shard named in its index file."""
    if (path / WEIGHTS_FILE).exists():
        return load_file(str(path / WEIGHTS_FILE))
    index_file = path / WEIGHTS_INDEX_FILE
    if not index_file.exists():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} in {path}")
    shards = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
    state: dict[str, Tensor] = {}
    for shard in shards:
        state.update(load_file(str(path / shard)))
    return state

"""The transformer's building blocks (common/model.py assembles them): the KV cache, RMSNorm,
rotary position embeddings, grouped-query attention, the SwiGLU MLP, a decoder layer and the
decoder stack.

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

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.model_args import ModelArgs


class KVCache:
    """The contiguous cache of the module docstring: k/v tensors [L, B, H_kv, S_max, D], a
    token's k/v at slot `positions[b, t]` of row b."""

    draft_kv = False
    """Forwards over this cache through the model's ``draft_exit_layer`` also write its draft
    adapter's KV into the extra cache layer (set where the adapter drafts: the rollout engine)."""

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
            args.cache_layers,
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
        else:
            if rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        out = out.view(B, self.num_heads, T, self.head_dim)  # [B, H_q, T, D]
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

"""Llama/Qwen2/Qwen3-compatible decoder-only transformer in plain PyTorch, with HF-format I/O.

The torch engine (actors) and the learner both run this model. Parameter names equal the Hugging
Face names exactly, so a `state_dict` maps 1:1 onto a `config.json + model.safetensors` checkpoint
that `transformers` and vLLM open directly, and onto the weight chunks published through Redis.

Architecture: pre-norm decoder layers (RMSNorm), rotary position embeddings (HF `rotate_half`
convention; rope types `default`, `linear` and `llama3`, the static ones whose frequencies do not
depend on the sequence length), grouped-query attention, SwiGLU MLP. Two switches cover the
Qwen families: `attention_bias` (Qwen2: bias on q/k/v, none on o) and `qk_norm` (Qwen3: per-head
RMSNorm on q and k before RoPE).

The building blocks and the KV cache's semantics: common/layers.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from common.eagle import EAGLE_FILE, EAGLE_PREFIX, EagleHead
from common.layers import (
    DecoderLayer,
    DecoderStack,
    KVCache,
    RMSNorm,
    rope_cos_sin,
)
from common.model_args import INIT_STD, ModelArgs, with_tied_head, without_tied_head

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
DRAFT_FILE = "draft/model.safetensors"
"""The draft adapter's tensors (``draft.*``), apart from the checkpoint other tools read: in a
subdirectory, because vLLM and transformers load every ``*.safetensors`` at the top level."""
DRAFT_PREFIX = "draft."


class DraftAdapter(nn.Module):
    """The trained self-draft's own parameters (docs/design.md §2.1): one decoder layer and a
    norm that read the residual stream after ``args.draft_exit_layer`` layers, and the token ids
    of its reduced vocabulary. Its LM head is the policy's, frozen (rows ``vocab_ids``). The
    layer's KV lives in cache layer ``num_hidden_layers``, after the policy's."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.layer = DecoderLayer(args)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        size = args.draft_vocab_size or args.vocab_size
        self.vocab_ids: Tensor | None
        if args.draft_vocab_size:
            self.register_buffer("vocab_ids", torch.arange(size), persistent=True)
        else:
            self.vocab_ids = None  # the whole vocabulary: the LM head as it is
        # (the head's weight, its version counter, the gathered rows); the weight is held, so
        # the identity check cannot match a new tensor at a recycled address.
        self._head: tuple[Tensor, int | None, Tensor] | None = None

    def head_weight(self, lm_head: Tensor) -> Tensor:
        """The LM head rows of the draft vocabulary, detached (the head is frozen for the draft);
        the gathered copy is reused while the head's tensor is unchanged: the same tensor and,
        unless it is an inference tensor (a rollout engine's adopted weights, which nothing
        writes to; they have no version counter), the same version."""
        if self.vocab_ids is None:
            return lm_head.detach()
        version = None if lm_head.is_inference() else lm_head._version
        if self._head is None or self._head[0] is not lm_head or self._head[1] != version:
            with torch.no_grad():
                self._head = (lm_head, version, lm_head.index_select(0, self.vocab_ids))
        return self._head[2]


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
        self.draft = DraftAdapter(args) if args.draft_exit_layer else None
        self.eagle: nn.Module | None = None
        if args.has_eagle:
            self.eagle = EagleHead(args)
        self.tie_weights()
        init_weights(self)

    def tie_weights(self) -> None:
        """Make the LM head share the embedding Parameter when `tie_word_embeddings`."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(
        self, input_ids: Tensor, positions: Tensor | None = None, cache: KVCache | None = None
    ) -> Tensor:
        """Final-normed hidden states [B, T, H] after every layer; arguments as in `forward`."""
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        return self.model.norm(self.run_layers(x, positions, cache, 0, self.args.num_hidden_layers))

    def run_layers(
        self,
        x: Tensor,
        positions: Tensor | None,
        cache: KVCache | None,
        start: int,
        end: int,
        aux: list[Tensor] | None = None,
    ) -> Tensor:
        """Decoder layers ``[start, end)`` on the residual stream x [B, T, H] (before the final norm).

        Split execution is what early-exit drafting needs: the draft runs layers [0, E) and stops;
        verification resumes the same hidden states at layer E instead of recomputing them.
        ``aux``: appended with the residual stream after each of ``eagle_aux_layers`` layers that
        falls in (start, end] (and 0 when start is 0), the EAGLE-3 head's inputs.
        """
        if not 0 <= start <= end <= self.args.num_hidden_layers:
            raise ValueError(
                f"layer range [{start}, {end}) outside [0, {self.args.num_hidden_layers}]"
            )
        positions, mask, cos, sin = self._attention_inputs(x, positions, cache)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        exit_layer = self.args.draft_exit_layer
        # Only a forward that runs through the exit and on (a drafter's [0, E) writes its own).
        write_draft = cache is not None and cache.draft_kv and start < exit_layer < end
        taps = set(self.args.eagle_aux_layers) if aux is not None else set()
        if start == 0 and 0 in taps:
            aux.append(x)
        for i in range(start, end):
            kv = (cache, i, positions) if cache is not None else None
            if recompute and cache is None:
                # Activation checkpointing: keep each layer's input, recompute inside in backward.
                x = checkpoint(self.model.layers[i], x, cos, sin, mask, None, use_reentrant=False)
            else:
                x = self.model.layers[i](x, cos, sin, mask, kv)
            if write_draft and i == exit_layer - 1:
                # The adapter's KV at these positions, so later drafts can attend to them.
                kv = (cache, self.args.num_hidden_layers, positions)
                self.draft.layer(x, cos, sin, mask, kv)
            if i + 1 in taps:
                aux.append(x)
        return x

    def run_eagle(
        self, next_ids: Tensor, hidden: Tensor, positions: Tensor | None, cache: KVCache | None
    ) -> Tensor:
        """One EAGLE-3 head step (common/eagle.py): the embeddings of ``next_ids`` [B, T] (the
        token after each state's position) and ``hidden`` [B, T, H] (``eagle.combine`` of the
        auxiliary states, or the previous step's output) at ``positions`` (those of the states)
        -> the step's output before the final norm [B, T, H]; ``eagle.logits`` of it gives the
        draft's logits. With a cache, the head's KV is written at ``positions`` first."""
        if self.eagle is None:
            raise ValueError("this model has no EAGLE-3 head (ModelArgs.eagle_aux_layers empty)")
        embeds = self.model.embed_tokens(next_ids)
        positions, mask, cos, sin = self._attention_inputs(hidden, positions, cache)
        kv = (cache, self.args.eagle_cache_layer, positions) if cache is not None else None
        return self.eagle.midlayer(embeds, hidden, cos, sin, mask, kv)

    def run_draft(
        self, h: Tensor, positions: Tensor | None, cache: KVCache | None, head: bool = True
    ) -> Tensor | None:
        """The adapter on the residual stream after ``draft_exit_layer`` layers, h [B, T, H]:
        logits [B, T, V_draft] float32 over its vocabulary (``draft.vocab_ids``; all of it when
        None). With a cache, writes the adapter's KV at ``positions`` first; ``head=False``
        stops there (returns None)."""
        out = self.draft_hidden(h, positions, cache)
        if not head:
            return None
        return F.linear(out, self.draft.head_weight(self.lm_head.weight)).float()

    def draft_hidden(self, h: Tensor, positions: Tensor | None, cache: KVCache | None) -> Tensor:
        """The adapter's layer and norm on h [B, T, H] (see ``run_draft``): [B, T, H]."""
        if self.draft is None:
            raise ValueError("this model has no draft adapter (ModelArgs.draft_exit_layer = 0)")
        positions, mask, cos, sin = self._attention_inputs(h, positions, cache)
        kv = (cache, self.args.num_hidden_layers, positions) if cache is not None else None
        return self.draft.norm(self.draft.layer(h, cos, sin, mask, kv))

    def _attention_inputs(
        self, x: Tensor, positions: Tensor | None, cache: KVCache | None
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """(positions [B, T], mask, cos, sin) of a forward over x [B, T, H]."""
        B, T, _ = x.shape
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
        return positions, mask, cos, sin

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
        cache: written at `positions`, then attended to (module docstring).
        num_layers: run only the first `num_layers` decoder layers, then the final norm and the
            LM head (early-exit drafting, LayerSkip style); with a cache only those layers' slots
            are written.
        """
        L = self.args.num_hidden_layers
        num_layers = L if num_layers is None else num_layers
        if not 1 <= num_layers <= L:
            raise ValueError(f"num_layers={num_layers} must be in [1, {L}]")
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        return self.head(self.run_layers(x, positions, cache, 0, num_layers))


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


def attach_draft(model: Transformer, exit_layer: int, vocab_ids: Tensor | None = None) -> None:
    """Give ``model`` a fresh draft adapter after layer ``exit_layer``: a copy of layer
    ``exit_layer`` and of the final norm (the start Kangaroo uses), over
    ``vocab_ids`` (sorted unique token ids; None = the whole vocabulary). Replaces any adapter."""
    vocab = 0
    if vocab_ids is not None:
        vocab_ids = torch.unique(vocab_ids.to(torch.long))  # sorted
        vocab = int(vocab_ids.numel())
    args = replace(model.args, draft_exit_layer=exit_layer, draft_vocab_size=vocab)
    weight = model.lm_head.weight
    draft = DraftAdapter(args).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        draft.layer.load_state_dict(model.model.layers[exit_layer].state_dict())
        draft.norm.load_state_dict(model.model.norm.state_dict())
        if vocab_ids is not None:
            draft.vocab_ids = vocab_ids.to(weight.device)
    model.args, model.draft = args, draft


def save_pretrained(model: Transformer, path: str | Path) -> None:
    """Write `config.json` + `model.safetensors` (HF layout) into `path`, creating it, and the
    draft adapter's tensors, if any, into `draft/model.safetensors`.

    Tensors keep the model's dtype (recorded as `torch_dtype`); a tied LM head is omitted, as HF
    does, since safetensors refuses shared storage.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {
        name: t.detach().contiguous().cpu()
        for name, t in without_tied_head(model.state_dict(), model.args).items()
    }
    dtype = model.lm_head.weight.dtype
    (path / CONFIG_FILE).write_text(json.dumps(model.args.to_hf_config(dtype), indent=2) + "\n")
    write_weights(state, path)


def write_weights(tensors: dict[str, Tensor], path: Path) -> None:
    """``model.safetensors`` in ``path``, the draft adapter's tensors (``draft.*``, if any) in
    ``draft/model.safetensors`` and the EAGLE-3 head's (``eagle.*``) in ``eagle/model.safetensors``
    (each removed when there are none), ``tensors`` left as given."""
    draft = {k: t for k, t in tensors.items() if k.startswith(DRAFT_PREFIX)}
    eagle = {k: t for k, t in tensors.items() if k.startswith(EAGLE_PREFIX)}
    policy = {k: t for k, t in tensors.items() if k not in draft and k not in eagle}
    save_file(policy, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    for part, name in ((draft, DRAFT_FILE), (eagle, EAGLE_FILE)):
        if part:
            (path / name).parent.mkdir(exist_ok=True)
            save_file(part, str(path / name), metadata={"format": "pt"})
        else:
            (path / name).unlink(missing_ok=True)


def save_part(
    path: str | Path, module: nn.Module, prefix: str, file: str, **config: object
) -> None:
    """Write ``module``'s tensors (keys ``prefix`` + name, floating ones in the checkpoint's
    dtype) as ``file`` into the existing checkpoint directory ``path`` and ``config`` into its
    ``config.json``, leaving the model's own tensors as they are: how the draft adapter and the
    EAGLE-3 head are saved."""
    path = Path(path)
    cfg = json.loads((path / CONFIG_FILE).read_text())
    dtype = getattr(torch, cfg.get("torch_dtype") or "float32")
    state = {
        prefix + name: t.detach()
        .to("cpu", dtype if t.is_floating_point() else t.dtype)
        .contiguous()
        for name, t in module.state_dict().items()
    }
    (path / file).parent.mkdir(exist_ok=True)
    save_file(state, str(path / file), metadata={"format": "pt"})
    cfg.update(config)
    (path / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")


def save_draft(model: Transformer, path: str | Path) -> None:
    """Write the draft adapter of ``model`` into the existing checkpoint directory ``path``
    (``draft/model.safetensors``, and its two keys in ``config.json``), leaving the model's own
    tensors as they are; the adapter's tensors keep the dtype of the checkpoint's."""
    if model.draft is None:
        raise ValueError("the model has no draft adapter to save")
    args = model.args
    save_part(
        path,
        model.draft,
        DRAFT_PREFIX,
        DRAFT_FILE,
        draft_exit_layer=args.draft_exit_layer,
        draft_vocab_size=args.draft_vocab_size,
    )


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
    if args.draft_exit_layer:
        state.update(load_file(str(path / DRAFT_FILE)))
    if args.has_eagle:
        state.update(load_file(str(path / EAGLE_FILE)))
    # Some tied checkpoints still store the head; the embedding is the one source of truth.
    state = without_tied_head(state, args)
    state = {
        k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
        for k, v in state.items()
    }
    state = with_tied_head(state, args)

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

"""The policy's EAGLE-3 draft head (docs/design.md §2.1): part of every published version.

It computes what vLLM 0.32's ``Eagle3LlamaForCausalLM`` computes (``llama_eagle3.py``), with its
checkpoint's tensor names under the ``eagle.`` prefix, so one set of tensors drives the torch
engine and vLLM's native ``eagle3`` proposer:

- ``fc`` [H, n·H] folds the policy's residual stream after each of ``eagle_aux_layers`` layers
  (concatenated in that order) into one state g_t;
- one decoder layer (``midlayer``) whose attention reads [norm(e(x_{t+1})) ‖ norm(g_t)] (2H wide)
  with g_t as the residual; its output before the final norm feeds the next draft step in place
  of g;
- ``norm`` and its own ``lm_head`` over ``eagle_vocab_size`` draft tokens; draft id j stands for
  target id j + ``d2t[j]``.

Draft sharpening (``EagleHead.sharpening`` = s, calibrated by ``specrl warm-draft``): the stored
and published ``lm_head`` holds the trained rows divided by s, so both engines draft from
softmax(z / (T·s)) with no code of their own; training multiplies the logits by s back
(``EagleHead.trained_logits``), so what is trained stays the unsharpened head. Exactness never
depends on s: the verifier is handed the q the drafts were sampled from.

The head is always Llama-form (no bias, no q/k norm), whatever the policy's layout; its heads,
widths and RoPE are the policy's. Its layer's KV lives in cache layer ``args.eagle_cache_layer``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from common.layers import MLP, Attention, RMSNorm
from common.model_args import ModelArgs

EAGLE_PREFIX = "eagle."
EAGLE_FILE = "eagle/model.safetensors"
EAGLE_SHARPENING_KEY = "eagle_draft_sharpening"
"""``config.json``'s record of a head's draft sharpening s (``EagleHead.sharpening``): its
``lm_head`` holds the trained rows over s. Written by ``specrl warm-draft`` and into every
checkpoint and version; the learner reads it back (``learner/wiring.py``)."""
"""The head's tensors (``eagle.*``) in a model directory: in a subdirectory, apart from the
checkpoint other tools read, because vLLM and transformers load every ``*.safetensors`` at the
top level (as the draft adapter's, common/model.py ``DRAFT_FILE``)."""


class EagleLayer(nn.Module):
    """``midlayer``: the decoder layer over [norm(embedding) ‖ norm(hidden)], residual hidden."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        H = args.hidden_size
        self.input_layernorm = RMSNorm(H, args.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, args.rms_norm_eps)
        self.self_attn = Attention(args)
        # q/k/v read the 2H-wide concatenation.
        attn = self.self_attn
        attn.q_proj = nn.Linear(2 * H, attn.q_proj.out_features, bias=False)
        attn.k_proj = nn.Linear(2 * H, attn.k_proj.out_features, bias=False)
        attn.v_proj = nn.Linear(2 * H, attn.v_proj.out_features, bias=False)
        self.post_attention_layernorm = RMSNorm(H, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self,
        embeds: Tensor,  # [B, T, H] embeddings of the tokens after the states' positions
        hidden: Tensor,  # [B, T, H] fc(aux) (first step) or the previous step's output
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        kv: tuple[Any, int, Tensor] | None,
    ) -> Tensor:
        """The layer's output before the final norm [B, T, H] (vLLM's ``hidden_prenorm``)."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        r = hidden + self.self_attn(x, cos, sin, mask, kv)
        return r + self.mlp(self.post_attention_layernorm(r))


class EagleHead(nn.Module):
    """The head's parameters and computation (module docstring); ``Transformer.eagle``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if not args.eagle_aux_layers:
            raise ValueError("an EAGLE-3 head needs ModelArgs.eagle_aux_layers")
        H = args.hidden_size
        layer_args = replace(args, attention_bias=False, qk_norm=False)
        self.fc = nn.Linear(len(args.eagle_aux_layers) * H, H, bias=False)
        self.midlayer = EagleLayer(layer_args)
        self.norm = RMSNorm(H, args.rms_norm_eps)
        size = args.eagle_vocab_size or args.vocab_size
        self.lm_head = nn.Linear(H, size, bias=False)
        # Offsets: draft id j is target id j + d2t[j] (zeros for the whole vocabulary).
        self.register_buffer("d2t", torch.zeros(size, dtype=torch.long), persistent=True)
        self.sharpening = 1.0
        """s: ``lm_head`` holds the trained rows divided by s (module docstring)."""

    @property
    def vocab_ids(self) -> Tensor:
        """Target ids of the draft vocabulary, [V_draft] sorted."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def to_target(self, draft_ids: Tensor) -> Tensor:
        """Target token ids of draft ids (any shape)."""
        return draft_ids + self.d2t[draft_ids]

    def combine(self, aux: list[Tensor] | Tensor) -> Tensor:
        """fc over the auxiliary states ([B, T, H] each, in layer order, or already
        concatenated [B, T, n·H]): the first step's hidden input [B, T, H]."""
        if isinstance(aux, list | tuple):
            aux = torch.cat(list(aux), dim=-1)
        return self.fc(aux)

    def logits(self, prenorm: Tensor) -> Tensor:
        """Draft logits [B, T, V_draft] float32 from a step's output before the final norm: the
        engines' (sharpened by ``sharpening``)."""
        return self.lm_head(self.norm(prenorm)).float()

    def trained_logits(self, prenorm: Tensor) -> Tensor:
        """The unsharpened logits the head is trained on: ``logits`` times ``sharpening``."""
        logits = self.logits(prenorm)
        return logits if self.sharpening == 1.0 else logits * self.sharpening

    @torch.no_grad()
    def set_sharpening(self, s: float) -> None:
        """Sharpen the drafts by ``s`` (in (0, 1]: softmax(z / (T·s))): the LM head's rows are
        rescaled from the current sharpening to ``s``; the trained logits do not change."""
        if not 0.0 < s <= 1.0:
            raise ValueError(f"draft sharpening must be in (0, 1], got {s}")
        self.lm_head.weight.mul_(self.sharpening / s)
        self.sharpening = float(s)


def attach_eagle(
    model: nn.Module,
    aux_layers: tuple[int, ...] | None = None,
    vocab_ids: Tensor | None = None,
    seed: int = 0,
    init: str = "layer",
) -> None:
    """Give ``model`` (a ``common.model.Transformer``) a fresh EAGLE-3 head reading
    ``aux_layers`` (default: vLLM's, ``default_eagle_aux_layers``) and drafting over
    ``vocab_ids`` (sorted unique target ids; None = the whole vocabulary). Its LM head starts as
    the policy's rows of those ids and its final norm as the policy's (as NeMo RL starts its
    head). ``init="layer"``: fc and its layer make the policy's last decoder layer applied to
    the top auxiliary state (:func:`init_from_last_layer`), so the untrained head already drafts
    what that layer predicts from there (step-1 acceptance 0.40 -> 0.52 after the same warm
    start on SmolLM2, shared notes); ``"random"``: every Linear N(0, INIT_STD) from ``seed``.
    Replaces any head."""
    from common.model_args import INIT_STD, default_eagle_aux_layers

    if init not in ("layer", "random"):
        raise ValueError(f"init must be 'layer' or 'random', got {init!r}")

    args = model.args
    layers = tuple(aux_layers) if aux_layers else default_eagle_aux_layers(args.num_hidden_layers)
    vocab = 0
    if vocab_ids is not None:
        vocab_ids = torch.unique(vocab_ids.to(torch.long))  # sorted
        vocab = int(vocab_ids.numel())
    args = replace(args, eagle_aux_layers=layers, eagle_vocab_size=vocab)
    weight = model.lm_head.weight
    head = EagleHead(args).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        if init == "layer":
            init_from_last_layer(head, model.model.layers[-1])
        else:
            generator = torch.Generator(device=weight.device).manual_seed(seed)
            for module in head.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, INIT_STD, generator=generator)
        head.norm.load_state_dict(model.model.norm.state_dict())
        if vocab_ids is None:
            head.lm_head.weight.copy_(weight)
        else:
            vocab_ids = vocab_ids.to(weight.device)
            head.lm_head.weight.copy_(weight.index_select(0, vocab_ids))
            head.d2t.copy_(vocab_ids - torch.arange(vocab, device=weight.device))
    model.args, model.eagle = args, head


@torch.no_grad()
def init_from_last_layer(head: EagleHead, layer: nn.Module) -> None:
    """The head's ``fc`` and layer from the policy's decoder ``layer`` (its last): ``fc`` =
    [0 | ... | 0 | I] picks the top auxiliary state g; q/k/v read only its half of the input
    (the policy's weights on the hidden half, zero on the embedding half); o_proj, the MLP and
    the post-attention norm are the layer's, ``hidden_norm`` is its input norm (the embedding
    norm too, unused while that half is zero). The head's first step is then the layer applied
    to g: ``g + attn(norm(g))``, then its MLP. A layer with q/k/v biases or q/k norms (the head
    has neither) gives its weights only."""
    mid, attn = head.midlayer, layer.self_attn
    H = head.fc.out_features
    head.fc.weight.zero_()
    head.fc.weight[:, -H:].copy_(torch.eye(H))
    for name in ("q_proj", "k_proj", "v_proj"):
        target = getattr(mid.self_attn, name).weight
        target.zero_()
        target[:, H:].copy_(getattr(attn, name).weight)
    mid.self_attn.o_proj.weight.copy_(attn.o_proj.weight)
    mid.mlp.load_state_dict(layer.mlp.state_dict())
    mid.input_layernorm.load_state_dict(layer.input_layernorm.state_dict())
    mid.hidden_norm.load_state_dict(layer.input_layernorm.state_dict())
    mid.post_attention_layernorm.load_state_dict(layer.post_attention_layernorm.state_dict())

"""The policy the learner trains: the built-in ``common.model.Transformer`` or any Hugging Face
causal LM (``AutoModelForCausalLM``), behind one small interface: ``backbone`` (final-normed
hidden states, and those after ``exit_layer`` layers for the early-exit loss), ``model.lm_head``
(applied by the step only at completion positions, see ``learner/microbatch.py``) and
``decoder_layers`` (FSDP2 shards each one as a unit).

``PolicyModule`` makes the whole loss computation one ``forward``: FSDP2 gathers the root's
parameters (embedding, final norm, LM head) for a forward, so the LM head must be called inside
one. A Hugging Face Llama/Qwen2/Qwen3 model has exactly the built-in model's parameter names, so
the actors' torch engine and vLLM load its published versions.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from common.eagle import EAGLE_SHARPENING_KEY
from common.model import CONFIG_FILE, Transformer, load_pretrained
from common.model_args import Layout, ModelArgs, layout_from_hf_config

log = logging.getLogger(__name__)


def is_builtin(model: nn.Module) -> bool:
    return isinstance(model, Transformer)


def num_layers(model: nn.Module) -> int:
    return model.args.num_hidden_layers if is_builtin(model) else model.config.num_hidden_layers


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)


def backbone(
    model: nn.Module,
    input_ids: Tensor,
    exit_layer: int = 0,
    raw_exit: bool = False,
    aux: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(final-normed hidden states [B, S, H], final-normed hidden states after ``exit_layer``
    layers or None; with ``raw_exit`` (built-in model) the residual stream there, not normed:
    what the draft adapter reads). Rows are right-padded, so plain causal attention is exact
    for every real token (pads come after them). ``aux`` (built-in model): appended with the
    EAGLE-3 head's inputs, the residual stream after each of ``eagle_aux_layers`` layers."""
    L = num_layers(model)
    if exit_layer and not 1 <= exit_layer < L:
        raise ValueError(f"spec.exit_layer={exit_layer} must be in [1, {L - 1}]")
    norm = model.model.norm
    if is_builtin(model):
        x = model.model.embed_tokens(input_ids)  # [B, S, H]
        if not exit_layer:
            return norm(model.run_layers(x, None, None, 0, L, aux=aux)), None
        h_exit = model.run_layers(x, None, None, 0, exit_layer, aux=aux)
        h = model.run_layers(h_exit, None, None, exit_layer, L, aux=aux)
        return norm(h), h_exit if raw_exit else norm(h_exit)
    if aux is not None:
        raise ValueError("the EAGLE-3 head's inputs need the built-in model")
    out = model.model(input_ids=input_ids, use_cache=False, output_hidden_states=bool(exit_layer))
    h = out.last_hidden_state  # already through the final norm
    if not exit_layer:
        return h, None
    # hidden_states[k] is the residual stream after k decoder layers (k=0: the embeddings).
    return h, norm(out.hidden_states[exit_layer])


def set_activation_checkpointing(model: nn.Module, enabled: bool) -> None:
    if is_builtin(model):
        model.gradient_checkpointing = enabled
    elif enabled and not model.is_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif not enabled and model.is_gradient_checkpointing:
        model.gradient_checkpointing_disable()


class PolicyModule(nn.Module):
    """Root module of a training step: ``forward(fn, *args)`` runs ``fn(policy, *args)`` inside
    the root's forward, so under FSDP2 the root parameters are gathered while ``fn`` runs."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, fn, *args: Any) -> Any:
        return fn(self.policy, *args)


def unwrap(model: nn.Module) -> nn.Module:
    return model.policy if isinstance(model, PolicyModule) else model


# ------------------------------------------------------------------------------ config, I/O


def hf_config(model: nn.Module, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of the checkpoint/version this model writes (tensors in ``dtype``)."""
    if is_builtin(model):
        cfg = model.args.to_hf_config(dtype)
    else:
        cfg = model.config.to_dict()
        cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
    head = getattr(model, "eagle", None)
    if head is not None and head.sharpening != 1.0:
        # Its LM head is stored over s: a resume must know s to train the rows it holds.
        cfg[EAGLE_SHARPENING_KEY] = head.sharpening
    return cfg


def model_args(model: nn.Module) -> Layout:
    """What published versions describe the policy by (``common.policy_meta``): the built-in
    :class:`ModelArgs`, or for any other ``transformers`` model its own config as an
    :class:`HFLayout` (served by ``engine=vllm``). A config the actors could not serve the
    trained distribution from (logits transformed after the LM head, no architecture or context
    length) is refused here, before any training."""
    if is_builtin(model):
        return model.args
    cfg = model.config.to_dict()
    cfg["architectures"] = cfg.get("architectures") or [type(model).__name__]
    try:
        return layout_from_hf_config(cfg)
    except ValueError as e:
        raise ValueError(
            f"the learner can train this {type(model).__name__}, but actors could not load its "
            f"published versions: {e}"
        ) from e


def choose_impl(model_dir: Path, impl: str) -> str:
    if impl != "auto":
        return impl
    try:
        ModelArgs.from_hf_config(json.loads((model_dir / CONFIG_FILE).read_text()))
        return "builtin"
    except ValueError:
        return "hf"


def load_policy(
    model_dir: Path, impl: str, device: torch.device, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The policy from an HF-format directory: the built-in model (``builtin``), a
    ``transformers`` ``AutoModelForCausalLM`` (``hf``), or whichever fits (``auto``: built-in for
    the Llama/Qwen2/Qwen3 layouts it computes exactly, ``transformers`` otherwise)."""
    if choose_impl(model_dir, impl) == "builtin":
        return load_pretrained(model_dir, device=device, dtype=dtype)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    return model.to(device)


def param_dtype(precision: str) -> torch.dtype:
    """Master-weight (and so gradient and AdamW-state) dtype for ``learner.precision``:
    fp32 for ``fp32`` and ``bf16-mixed`` (bf16 compute under autocast), bf16 for ``bf16``."""
    return torch.bfloat16 if precision == "bf16" else torch.float32

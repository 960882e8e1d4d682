"""What a weights version carries besides tensors: the model architecture and the tokenizer.

An actor on another machine needs nothing but the Redis URL to build the policy: the manifest's
``meta`` holds the HF ``config.json`` (the built-in model's, or a foreign model's own, see
:class:`~common.model_args.HFLayout`) and, for the built-in character tokenizer, its alphabet. A
Hugging Face tokenizer (and its chat template) is too large for the manifest; actors then load it
from ``model.path``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.config.modes import EAGLE_METHODS, EXIT_METHODS
from common.model_args import HFLayout, Layout, ModelArgs, layout_from_hf_config
from common.tokenizer import CharTokenizer, Tokenizer, load_tokenizer

HF_CONFIG = "hf_config"
CHAR_ALPHABET = "char_alphabet"


def policy_meta(args: Layout, tokenizer: Tokenizer) -> dict[str, str]:
    """The manifest meta of a version of the policy ``args`` describes."""
    meta = {HF_CONFIG: json.dumps(args.to_hf_config())}
    if isinstance(tokenizer, CharTokenizer):
        meta[CHAR_ALPHABET] = tokenizer.alphabet
    return meta


def hf_config_from_meta(meta: Mapping[str, object]) -> dict[str, Any]:
    raw = meta.get(HF_CONFIG)
    if not isinstance(raw, str):
        raise ValueError(f"weights manifest meta has no {HF_CONFIG!r}; was it published by specrl?")
    return json.loads(raw)


def layout_from_meta(meta: Mapping[str, object]) -> Layout:
    """The published model's architecture: :class:`ModelArgs` for the layouts the built-in model
    computes, else an :class:`HFLayout`."""
    return layout_from_hf_config(hf_config_from_meta(meta))


def model_args_from_meta(meta: Mapping[str, object]) -> ModelArgs:
    """The built-in model's arguments; refuses a foreign layout with the reason."""
    return ModelArgs.from_hf_config(hf_config_from_meta(meta))


ENGINE_TORCH_LAYOUTS = (
    "engine=torch builds this repository's transformer, which computes the Llama, Qwen2 and "
    "Qwen3 layouts; this model is model_type={model_type!r} ({reason}); use engine=vllm, which "
    "serves any architecture the installed vLLM supports"
)
SPEC_NEEDS_BUILTIN = (
    "spec={method} drafts with the policy's own first layers (the early exit or the trained "
    "self-draft) or its EAGLE-3 head, which needs the built-in Llama, Qwen2 or Qwen3 layout; "
    "this model is "
    "model_type={model_type!r} ({reason}); use spec=ngram or spec=none"
)


def check_rollout_support(layout: Layout, engine: str, spec_method: str, adapter: bool) -> None:
    """Refuse, with the reason, an engine or drafting method that cannot run this layout: the
    torch engine, the early-exit drafts (``spec.adapter`` included) and the EAGLE-3 head need
    :class:`ModelArgs`."""
    if not isinstance(layout, HFLayout):
        return
    fields = {"model_type": layout.model_type, "reason": layout.reason or "not a built-in layout"}
    if engine == "torch":
        raise ValueError(ENGINE_TORCH_LAYOUTS.format(**fields))
    if spec_method in EXIT_METHODS or spec_method in EAGLE_METHODS or adapter:
        raise ValueError(SPEC_NEEDS_BUILTIN.format(method=spec_method, **fields))


def tokenizer_from_meta(meta: Mapping[str, object], model_path: str) -> Tokenizer:
    alphabet = meta.get(CHAR_ALPHABET)
    if isinstance(alphabet, str):
        return CharTokenizer(alphabet)
    if not model_path:
        raise ValueError(
            "the published model uses a Hugging Face tokenizer: give the actor model.path=DIR "
            "(a local copy of the model directory)"
        )
    return load_tokenizer(Path(model_path))

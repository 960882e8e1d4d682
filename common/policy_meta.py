"""What a weights version carries besides tensors: the model architecture and the tokenizer.

An actor on another machine needs nothing but the Redis URL to build the policy: the manifest's
``meta`` holds the HF ``config.json`` and, for the built-in character tokenizer, its alphabet. A
Hugging Face tokenizer is too large for the manifest; actors then load it from ``model.path``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from common.model_args import ModelArgs
from common.tokenizer import CharTokenizer, Tokenizer, load_tokenizer

HF_CONFIG = "hf_config"
CHAR_ALPHABET = "char_alphabet"


def policy_meta(args: ModelArgs, tokenizer: Tokenizer) -> dict[str, str]:
    meta = {HF_CONFIG: json.dumps(args.to_hf_config())}
    if isinstance(tokenizer, CharTokenizer):
        meta[CHAR_ALPHABET] = tokenizer.alphabet
    return meta


def model_args_from_meta(meta: Mapping[str, object]) -> ModelArgs:
    raw = meta.get(HF_CONFIG)
    if not isinstance(raw, str):
        raise ValueError(f"weights manifest meta has no {HF_CONFIG!r}; was it published by specrl?")
    return ModelArgs.from_hf_config(json.loads(raw))


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

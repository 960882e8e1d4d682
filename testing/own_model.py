"""A user's own model, made in the test: a byte-level BPE tokenizer from the ``tokenizers``
library with a Qwen-style chat template, wrapped in ``transformers.PreTrainedTokenizerFast``,
next to a tiny Qwen2 model with random weights made by ``transformers`` itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: ChatML, as Qwen2 instruct tokenizers carry it (no BOS; the system turn only when given).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = [
    "Tom has 3 apples and buys 4 more. How many apples does he have? #### 7",
    "A train travels 60 miles in 2 hours. What is its speed? #### 30",
    "Mia reads 12 pages a day for 5 days. How many pages? #### 60",
    "You are a careful math tutor. Think step by step.",
    "The answer is \\boxed{42}.",
]


def build_tokenizer(directory: Path, chat_template: bool = True):
    """Train the tokenizer and save it into ``directory``; returns the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def tiny_hf_config(kind: str = "qwen2", **fields: Any):
    """A transformers config of ``kind`` ("llama" or "qwen2") in the small shape of the built-in
    test models (``testing.models.SMALL_SHAPE``), with untied embeddings and any field overridden."""
    import transformers

    from testing.models import SMALL_SHAPE

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    return cls(**{**SMALL_SHAPE, "tie_word_embeddings": False, **fields})


def build_model(directory: Path, seed: int = 0) -> Path:
    """A tiny Qwen2 (hidden 64, 2 layers, head_dim 32) with random weights and the tokenizer
    above, saved with ``save_pretrained`` into ``directory`` (a local HF model directory)."""
    import torch
    import transformers

    tokenizer = build_tokenizer(directory)
    torch.manual_seed(seed)
    config = tiny_hf_config(
        vocab_size=len(tokenizer),
        head_dim=32,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    return directory


def write_parquet(path: Path, rows: list[dict]) -> Path:
    """``rows`` as a Parquet file (columns from the first row's keys)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path

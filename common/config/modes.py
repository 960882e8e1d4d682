"""The named choices of config fields, each set defined once.

The section dataclasses validate their fields against these sets in ``__post_init__``; code
below the entry points receives validated values and compares against single members.
"""

from __future__ import annotations

TASK_NAMES: tuple[str, ...] = (
    "reverse",
    "addition",
    "scratchpad",
    "word_problems",
    "dataset",
    "jsonl",
)
"""``task.name``: the built-in tasks, then the two names of the data-set task."""
DATASET_TASKS: tuple[str, ...] = ("dataset", "jsonl")
"""``task.name`` values whose prompts come from a file (``jsonl`` is an alias of ``dataset``)."""
DATASET_FORMATS: tuple[str, ...] = ("auto", "jsonl", "parquet")
"""``task.format``: a file format, or ``auto`` (from the file's suffix)."""
DATASET_SUFFIXES: dict[str, str] = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
"""File suffixes ``task.format=auto`` recognises, and the format each names."""
CHAT_TEMPLATE_MODES: tuple[str, ...] = ("auto", "true", "false")
"""``task.chat_template``."""

SPEC_METHODS: tuple[str, ...] = ("none", "early_exit", "ngram", "hybrid", "eagle3", "auto")
"""``spec.method``: the drafting methods, and ``auto`` (resolved by engine, see
:data:`AUTO_SPEC_METHOD`)."""
AUTO_SPEC_METHOD: dict[str, str] = {"torch": "hybrid", "vllm": "early_exit"}
"""What ``spec.method=auto`` becomes on each engine when the config is loaded: the early exit
(the trained self-draft with ``spec.adapter``) plus n-gram drafts on the torch engine; the early
exit alone on vLLM, which runs one proposer per engine."""
EXIT_METHODS: tuple[str, ...] = ("early_exit", "hybrid", "auto")
"""Spec methods that draft with the early exit (and co-train it); ``auto`` does on every
engine."""
EAGLE_METHODS: tuple[str, ...] = ("eagle3",)
"""Spec methods that draft with the policy's EAGLE-3 head (``common/eagle.py``)."""
NGRAM_METHODS: tuple[str, ...] = ("ngram", "hybrid")
"""Spec methods that draft from n-gram matches in the history."""
NGRAM_SOURCES: tuple[str, ...] = ("prompt", "group", "history")
"""``spec.ngram_sources``: what n-gram drafts copy from, each level adding to the one before:
``prompt`` = the row's own prompt and completion so far (vLLM's built-in ``ngram``); ``group`` =
also the other rows of the call with the same prompt (the GRPO group); ``history`` = also earlier
completions of the prompt (from earlier epochs over a training set)."""

INFLIGHT_MODES: tuple[str, ...] = ("verify_on_swap", "verify_on_finish", "abort", "keep")
"""``actor.inflight``: what new weights do to rollouts in flight."""
VLLM_INFLIGHT_MODES: tuple[str, ...] = ("verify_on_swap", "abort", "keep")
"""The ``actor.inflight`` modes the vLLM engine supports (``verify_on_finish`` is torch-only)."""

ENGINE_NAMES: tuple[str, ...] = ("torch", "vllm")
"""``engine.name``: the rollout engines."""
TORCH_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
"""``engine.torch_dtype``: a torch dtype name, or ``auto`` (the published weights' dtype)."""

MODEL_IMPLS: tuple[str, ...] = ("auto", "builtin", "hf")
"""``learner.model_impl``: which implementation trains the policy."""
PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "bf16")
"""``learner.precision``: training precision."""
PUBLISH_DTYPES: tuple[str, ...] = ("", "bfloat16", "float16", "float32")
"""``learner.publish_dtype``: dtype of published weights; empty: the training dtype."""
PUBLISH_UPLOADS: tuple[str, ...] = ("process", "thread")
"""``learner.publish_upload``: where background uploads run (``common/weights/publish/publisher.py``)."""

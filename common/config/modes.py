"""The named choices of config fields, each set written once, as a ``Literal`` alias.

Each alias types a config field (``SpecConfig.method: SpecMethod``) and its tuple of values
(``SPEC_METHODS = get_args(SpecMethod)``) is what the section's ``__post_init__`` validates
against; code below the entry points receives validated values and compares against single
members, which a type checker now checks against the alias.

The config dataclasses take the aliases from :mod:`common.config.field_types`, where they are
these aliases for type checkers and ``str`` at run time (OmegaConf, which builds Hydra's schema
from the annotations, refuses ``Literal``); here, at run time too, every alias is the ``Literal``.
"""

from __future__ import annotations

from typing import Literal, get_args

TaskName = Literal[
    "reverse",
    "addition",
    "scratchpad",
    "word_problems",
    "lookup",
    "guess_number",
    "dataset",
    "jsonl",
]
"""``task.name``: the built-in tasks, then the two names of the data-set task."""
TASK_NAMES: tuple[TaskName, ...] = get_args(TaskName)
DATASET_TASKS: tuple[TaskName, ...] = ("dataset", "jsonl")
"""``task.name`` values whose prompts come from a file (``jsonl`` is an alias of ``dataset``)."""
DatasetFormat = Literal["auto", "jsonl", "parquet", "arrow", "disk"]
"""``task.format``: a file format, ``disk`` (a directory ``datasets`` saved), or ``auto`` (a
directory is ``disk``; a file's format is its suffix's)."""
DATASET_FORMATS: tuple[DatasetFormat, ...] = get_args(DatasetFormat)
DATASET_SUFFIXES: dict[str, DatasetFormat] = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
"""File suffixes ``task.format=auto`` recognises, and the format each names."""
RewardFailureMode = Literal["zero", "drop_group"]
"""``task.reward_on_failure``: a failed reward call gives 0, or its whole group is not sent."""
REWARD_FAILURE_MODES: tuple[RewardFailureMode, ...] = get_args(RewardFailureMode)
ChatTemplateMode = Literal["auto", "true", "false"]
"""``task.chat_template``."""
CHAT_TEMPLATE_MODES: tuple[ChatTemplateMode, ...] = get_args(ChatTemplateMode)

SpecMethod = Literal["none", "early_exit", "ngram", "hybrid", "eagle3", "auto"]
"""``spec.method``: the drafting methods, and ``auto`` (resolved by engine, see
:data:`AUTO_SPEC_METHOD`)."""
SPEC_METHODS: tuple[SpecMethod, ...] = get_args(SpecMethod)
EngineName = Literal["torch", "vllm"]
"""``engine.name``: the rollout engines."""
ENGINE_NAMES: tuple[EngineName, ...] = get_args(EngineName)
VllmWeightTransfer = Literal["auto", "reload", "specrl", "nccl"]
"""``engine.vllm_weight_transfer``: how versions reach vLLM (``actors/engines/vllm/setup.py``)."""
VLLM_WEIGHT_TRANSFERS: tuple[VllmWeightTransfer, ...] = get_args(VllmWeightTransfer)
AUTO_SPEC_METHOD: dict[EngineName, SpecMethod] = {"torch": "hybrid", "vllm": "early_exit"}
"""What ``spec.method=auto`` becomes on each engine when the config is loaded: the early exit
(the trained self-draft with ``spec.adapter``) plus n-gram drafts on the torch engine; the early
exit alone on vLLM, which runs one proposer per engine."""
EXIT_METHODS: tuple[SpecMethod, ...] = ("early_exit", "hybrid", "auto")
"""Spec methods that draft with the early exit (and co-train it); ``auto`` does on every
engine."""
EAGLE_METHODS: tuple[SpecMethod, ...] = ("eagle3",)
"""Spec methods that draft with the policy's EAGLE-3 head (``common/eagle.py``)."""
NGRAM_METHODS: tuple[SpecMethod, ...] = ("ngram", "hybrid")
"""Spec methods that draft from n-gram matches in the history."""
NgramSource = Literal["prompt", "group", "history"]
"""``spec.ngram_sources``: what n-gram drafts copy from, each level adding to the one before:
``prompt`` = the row's own prompt and completion so far (vLLM's built-in ``ngram``); ``group`` =
also the other rows of the call with the same prompt (the GRPO group); ``history`` = also earlier
completions of the prompt (from earlier epochs over a training set)."""
NGRAM_SOURCES: tuple[NgramSource, ...] = get_args(NgramSource)

InflightMode = Literal["verify_on_swap", "verify_on_finish", "abort", "keep"]
"""``actor.inflight``: what new weights do to rollouts in flight."""
INFLIGHT_MODES: tuple[InflightMode, ...] = get_args(InflightMode)
VLLM_INFLIGHT_MODES: tuple[InflightMode, ...] = ("verify_on_swap", "abort", "keep")
"""The ``actor.inflight`` modes the vLLM engine supports (``verify_on_finish`` is torch-only)."""

TorchDtype = Literal["auto", "float32", "bfloat16", "float16"]
"""``engine.torch_dtype``, ``engine.vllm_draft_dtype``: a torch dtype name, or ``auto`` (the
published weights' dtype; for the vLLM draft, bfloat16 where the device computes it fast)."""
TORCH_DTYPES: tuple[TorchDtype, ...] = get_args(TorchDtype)

ModelImpl = Literal["auto", "builtin", "hf"]
"""``learner.model_impl``: which implementation trains the policy."""
MODEL_IMPLS: tuple[ModelImpl, ...] = get_args(ModelImpl)
Precision = Literal["fp32", "bf16-mixed", "bf16"]
"""``learner.precision``: training precision."""
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
PublishDtype = Literal["", "bfloat16", "float16", "float32"]
"""``learner.publish_dtype``: dtype of published weights; empty: the training dtype."""
PUBLISH_DTYPES: tuple[PublishDtype, ...] = get_args(PublishDtype)
PublishUpload = Literal["process", "thread"]
"""``learner.publish_upload``: where background uploads run (``common/weights/publish/publisher.py``)."""
PUBLISH_UPLOADS: tuple[PublishUpload, ...] = get_args(PublishUpload)
CheckpointFormat = Literal["auto", "sharded", "full"]
"""``learner.checkpoint_format`` (``learner/checkpoint_sharded.py``)."""
CHECKPOINT_FORMATS: tuple[CheckpointFormat, ...] = get_args(CheckpointFormat)
LearnerProfile = Literal["auto", "manual", "off"]
"""``learner.profile``: how the memory settings meet the device's memory."""
LEARNER_PROFILES: tuple[LearnerProfile, ...] = get_args(LearnerProfile)

LossAggregation = Literal["token_mean", "seq_mean", "seq_sum"]
"""``learner.loss_agg``: how the per-token loss terms become one loss (``learner/loss.py``):
``token_mean`` = over every completion token of the batch; ``seq_mean`` = the mean over each
sequence's tokens, then over sequences; ``seq_sum`` = the sum of all token terms over (number of
sequences x a constant length), length-unbiased (Dr.GRPO)."""
LOSS_AGGREGATIONS: tuple[LossAggregation, ...] = get_args(LossAggregation)
RatioLevel = Literal["token", "sequence"]
"""``learner.ratio_level``: the importance ratio per token (PPO, GRPO), or one per sequence, the
exponential of the mean token log-ratio, clipped per sequence (GSPO)."""
RATIO_LEVELS: tuple[RatioLevel, ...] = get_args(RatioLevel)
OverlongMode = Literal["none", "mask", "penalty"]
"""``learner.overlong``: what happens to completions that hit the length limit: nothing; left out
of the loss (``mask``); or DAPO's soft length penalty added to every completion's reward
(``penalty``)."""
OVERLONG_MODES: tuple[OverlongMode, ...] = get_args(OverlongMode)
LrSchedule = Literal["constant", "linear", "cosine"]
"""``learner.lr_schedule``: the policy's learning rate after the warm-up, over ``run.steps``."""
LR_SCHEDULES: tuple[LrSchedule, ...] = get_args(LrSchedule)

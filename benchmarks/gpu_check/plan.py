"""The GPU check's shapes and budgets (a GPU plan and a tiny CPU plan), its run record and small
helpers shared by its stages (benchmarks/gpu_check/__init__.py says what it measures)."""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import cli
from testing.shapes import QWEN25_05B, SMOLLM2_135M, shape

ROOT = Path(__file__).resolve().parents[2]

TINY_FIELDS = dict(
    tie_word_embeddings=True, max_position_embeddings=256, eos_token_id=2, pad_token_id=2
)
TINY_ENGINE = shape(512, 64, 128, 4, 2, 1, **TINY_FIELDS)
TINY_LEARNER = shape(1024, 64, 128, 2, 2, 1, attention_bias=True, **TINY_FIELDS)
"""``--cpu``: 2 heads of 32 channels (the smallest head the engines' kernels are used with)."""


@dataclass(frozen=True)
class Plan:
    """The sizes of one mode (GPU or ``--cpu``)."""

    engine_shape: dict
    learner_shape: dict
    dtype: torch.dtype  # the engine's weights
    batches: tuple[int, ...]
    prompt_len: int
    max_new: int
    timed_calls: int  # per row and batch; the figure is their median
    k: int
    chain_size: int  # tokens of the Markov chain
    chain_fanout: int  # successors per token
    structure_steps: int
    structure_batch: int
    structure_lr: float
    structure_budget_s: float  # the training stops here if its steps take longer
    warmup_prompts: int  # the draft warm-up's prompts (an eighth held out), 2 samples each
    warmup_epochs: int
    draft_vocab: int
    lossless_samples: int  # per row and sampling setting
    learner_groups: int
    learner_prompt: int
    learner_completion: int  # completions are half to all of this long
    learner_microbatch_tokens: int
    learner_steps: int  # timed, after one warm-up step
    weight_rounds: int
    budget_s: float


PLANS = dict(  # field=(GPU, --cpu)
    engine_shape=(SMOLLM2_135M, TINY_ENGINE),
    learner_shape=(QWEN25_05B, TINY_LEARNER),
    dtype=(torch.bfloat16, torch.float32),
    batches=((1, 8, 32, 128), (1, 8)),
    prompt_len=(32, 16),
    max_new=(96, 24),
    timed_calls=(2, 1),
    k=(4, 4),
    chain_size=(1024, 96),
    chain_fanout=(8, 4),
    structure_steps=(300, 100),
    structure_batch=(64, 24),
    structure_lr=(1e-3, 3e-3),
    structure_budget_s=(90.0, 30.0),
    warmup_prompts=(96, 24),
    warmup_epochs=(6, 4),
    draft_vocab=(8192, 128),
    lossless_samples=(3000, 1200),
    learner_groups=(8, 2),
    learner_prompt=(128, 16),
    learner_completion=(384, 32),
    learner_microbatch_tokens=(16_384, 256),
    learner_steps=(3, 2),
    weight_rounds=(2, 2),
    budget_s=(420.0, 240.0),
)
GPU_PLAN = Plan(**{field: gpu for field, (gpu, _) in PLANS.items()})
CPU_PLAN = Plan(**{field: cpu for field, (_, cpu) in PLANS.items()})

LOSSLESS_ALPHA = 0.01
"""Family-wise level of the lossless check: each p-value must reach this over the tests' count."""
PROMPT_SEED, WARMUP_SEED, TRAIN_SEED = 11, 12, 13


class Run:
    """Progress lines, the figures, the errors and the deadline of one run."""

    def __init__(self, path: Path, budget_s: float) -> None:
        self.started = time.perf_counter()
        self.path, self.budget_s = path, budget_s
        self.figures: dict[str, Any] = {}
        self.errors: list[dict[str, str]] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def say(self, stage: str, message: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {stage}: {message}", flush=True)

    def stage(self, name: str, fn: Callable[[], dict[str, Any]]) -> bool:
        """``fn``'s figures into the JSON (rewritten now), or its error; whether it succeeded."""
        self.say(name, "start")
        started = time.perf_counter()
        try:
            self.figures.update(fn())
            ok = True
        except Exception as e:  # noqa: BLE001 - recorded, and the next stages still run
            self.errors.append(
                {"stage": name, "error": repr(e), "traceback": traceback.format_exc()[-4000:]}
            )
            traceback.print_exc()
            self.say(name, f"FAILED: {e!r}")
            ok = False
        seconds = round(time.perf_counter() - started, 1)
        self.figures.setdefault("stage_seconds", {})[name] = seconds
        self.say(name, f"done in {seconds}s")
        self.write()
        return ok

    def write(self) -> None:
        self.figures["errors"] = self.errors
        self.figures["seconds"] = round(self.elapsed(), 1)
        cli.write_json(self.figures, self.path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def params_of(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

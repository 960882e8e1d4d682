"""Stage 1 of the GPU check: the environment, and one bf16-mixed learner step."""

from __future__ import annotations

import json
import math
import platform
import resource
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

import torch

from benchmarks import cli
from benchmarks.gpu_check import ABSENT_ON_DEVICE
from benchmarks.gpu_check.plan import (
    ROOT,
    SMOLLM2_135M,
    Plan,
    Run,
    params_of,
    sync,
)
from common import metric_names as mn
from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.link.protocol import TrajectoryGroup
from common.model import Transformer
from common.model_args import ModelArgs
from common.model_presets import preset_dir
from common.weights.format import (
    dtype_name,
)
from learner.batch import collate
from learner.optim import make_optimizer
from learner.step import Trainer

# ------------------------------------------------------------------------------ environment


def environment(plan: Plan, device: torch.device, mode: str) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "mode": mode,
        "device": str(device),
        "device_name": (
            torch.cuda.get_device_name(device) if device.type == "cuda" else cli.cpu_model()
        ),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python": platform.python_version(),
        "imports_blocked": [n for n in ABSENT_ON_DEVICE if sys.modules.get(n, 0) is None],
        "engine_dtype": dtype_name(plan.dtype),
        "plan": {k: v for k, v in asdict(plan).items() if k != "dtype"},
    }
    figures["engine_shape_checked_against"] = check_engine_shape(plan)
    return figures


def check_engine_shape(plan: Plan) -> str | None:
    """The preset's config.json the GPU shape was checked against, None where it is absent (or
    in ``--cpu`` mode); a mismatch raises."""
    config = ROOT / preset_dir("smollm2-135m") / "config.json"
    if plan.engine_shape is not SMOLLM2_135M or not config.is_file():
        return None
    args = ModelArgs.from_hf_config(json.loads(config.read_text()))
    wrong = {
        k: (v, getattr(args, k))
        for k, v in SMOLLM2_135M.items()
        if not math.isclose(getattr(args, k), v, rel_tol=1e-6)  # its eps is float32-rounded
    }
    if wrong:
        raise ValueError(f"SMOLLM2_135M differs from {config} (ours, its): {wrong}")
    return str(config.relative_to(ROOT))


# ------------------------------------------------------------------------------ learner step


def random_groups(plan: Plan, vocab: int, seed: int) -> list[TrajectoryGroup]:
    """``learner_groups`` GRPO groups of 8 random completions (half to all of
    ``learner_completion`` tokens) of random prompts, random rewards."""
    groups = plan.learner_groups
    prompt, completion = plan.learner_prompt, plan.learner_completion
    return cli.random_groups(vocab, groups, 8, prompt, completion, seed, "gpu-check")


def learner_step(plan: Plan, device: torch.device, run: Run) -> tuple[dict[str, Any], Transformer]:
    """The figures, and the trained model (the weights stage publishes it)."""
    model = cli.random_model(device=device, **plan.learner_shape).train()
    cfg = LearnerConfig(
        lr=1e-5,
        precision="bf16-mixed",
        max_tokens_per_microbatch=plan.learner_microbatch_tokens,
        logprob_chunk_tokens=1024,
    )
    optimizer = make_optimizer(model, cfg)
    batch = collate(
        random_groups(plan, model.args.vocab_size, seed=0), 0, model.args.pad_token_id, device
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, metrics = [], {}
    for i in range(1 + plan.learner_steps):
        sync(device)
        started = time.perf_counter()
        metrics = Trainer(model, optimizer, cfg, SamplingConfig()).step(batch)
        sync(device)
        seconds = time.perf_counter() - started
        times += [seconds] if i else []
        run.say("learner", f"step {i} ({'timed' if i else 'warm-up'}): {seconds:.2f}s")
    if metrics[mn.LEARNER_SKIPPED]:
        raise RuntimeError(f"the learner skipped its step: {metrics}")
    seconds = statistics.median(times)
    tokens = batch.num_tokens
    if device.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    else:
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_max_rss"
    out = {
        "learner_params": params_of(model),
        "learner_precision": cfg.precision,
        "learner_rows": int(batch.input_ids.shape[0]),
        "learner_width": int(batch.input_ids.shape[1]),
        "learner_completion_tokens": tokens,
        "learner_microbatches": int(metrics[mn.LEARNER_MICROBATCHES]),
        "learner_step_s": round(seconds, 4),
        "learner_step_s_all": [round(t, 4) for t in times],
        "learner_tokens_per_s": round(tokens / seconds, 1),
        "learner_peak_mem_gb": round(peak / 1e9, 3),
        "learner_peak_mem_kind": kind,
        "learner_loss": metrics[mn.LEARNER_LOSS],
        "learner_grad_norm": metrics[mn.LEARNER_GRAD_NORM],
    }
    del optimizer, batch
    return out, model

"""The real-model preset as the benchmarks measure it (benchmarks/rollout_real.py, eagle_rows.py,
engines_real.py, engines_eagle.py): its directory with a warm-started draft adapter and EAGLE-3
head, its training prompts encoded as the actor does, one `specrl run` of it, and the policies
and held-out samples that measure a draft's drift over that run."""

from __future__ import annotations

import copy
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from common.config import load_config
from common.eagle import EAGLE_FILE
from common.model import DRAFT_FILE, Transformer, load_pretrained
from common.model_presets import preset_dir
from common.prompts import prompt_encoder
from common.tasks import task_from_config
from common.tokenizer import load_tokenizer
from learner.checkpoint import latest_checkpoint
from learner.prepare.draft_data import Decoding, Sample, sample_group

ROOT = Path(__file__).resolve().parent.parent
PRESET = "smollm2-135m"
OVERRIDES = [f"model={PRESET}", "task=word_problems"]
GROUP = 8
"""Samples per prompt in the rows with a batch above 1."""


def real_model_dir() -> Path:
    """The preset's HF directory with a warm-started draft adapter and a warm-started EAGLE-3
    head (each built on first use with `specrl warm-draft`; a directory that has one keeps it)."""
    model_dir = ROOT / preset_dir(PRESET)
    for draft_file, extra, what in (
        (DRAFT_FILE, [], "the draft adapter"),
        (EAGLE_FILE, ["spec=eagle3"], "the EAGLE-3 head"),
    ):
        if not (model_dir / draft_file).exists():
            cmd = [sys.executable, "-m", "ops.cli", "warm-draft", *OVERRIDES, *extra]
            print(f"warm-starting {what}: {' '.join(cmd[2:])} ...", flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True)
    return model_dir


def preset_prompts(cfg, tokenizer, task, count: int, skip: int) -> list[list[int]]:
    """``count`` training prompts from ``skip`` on, encoded as the actor does (chat template)."""
    encode = prompt_encoder(
        tokenizer, cfg.task.chat_template, cfg.task.system_prompt, cfg.task.natural_language
    )
    pool = list(task.problems)
    random.Random(2).shuffle(pool)
    unique = list({p.prompt_id: p for p in pool}.values())
    return [encode(p.prompt) for p in unique[skip : skip + count]]


def chunks_of(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    per = 1 if batch == 1 else max(1, batch // GROUP)
    return [prompts[i : i + per] for i in range(0, len(prompts), per)]


E2E_STEPS = 20
# Copied from each RL run's summary.json (ops/run_summary.py) as real_e2e_{spec}_{key}.
RL_SUMMARY_KEYS = (
    "actor_tokens_per_s",
    "trained_tokens_per_s",
    "groups_dropped_stale",
    "learner_wait_frac",
    "spec_acceptance_rate",
)


def rl_run(label: str, steps: int, extra: list[str]) -> tuple[float, dict, Path]:
    """One `specrl run` of the preset on its task: (wall seconds, its summary, its run dir)."""
    run_dir = ROOT / "runs" / "bench" / f"real-e2e-{label}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "ops.cli",
        "run",
        *OVERRIDES,
        f"run.steps={steps}",
        f"run.dir={run_dir}",
        f"run.name=bench-real-e2e-{label}",
        "learner.resume=false",
        *extra,
    ]
    print(f"RL run ({label}): {' '.join(cmd[2:])} ...", flush=True)
    started = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    return wall, json.loads((run_dir / "summary.json").read_text()), run_dir


def held_out_samples(model, cfg, tokenizer, task, prompts: int) -> list[Sample]:
    """Two completions of each of ``prompts`` held-out training prompts, sampled from a bf16
    copy of ``model`` with the states the draft reads (as `specrl warm-draft` evaluates)."""
    decoding = Decoding(
        task.max_new_tokens,
        model.args.draft_exit_layer or 1,  # the states recorded: any layer will do for a head
        tokenizer.eos_id,
        cfg.sampling.temperature,
        cfg.sampling.top_p,
    )
    encoded = preset_prompts(cfg, tokenizer, task, prompts, 1000)
    sampler = copy.deepcopy(model).to(torch.bfloat16)
    return sample_group(sampler, encoded, 2, decoding, torch.Generator().manual_seed(0))


class Drift(NamedTuple):
    """What a draft's drift over an RL run is measured on: the initial policy, the final one (the
    run's last checkpoint), the final one with the initial draft (``frozen``), held-out samples of
    the initial and of the final policy, and the preset's sampling temperature."""

    start: Transformer
    final: Transformer
    frozen: Transformer
    before: list[Sample]
    after: list[Sample]
    temperature: float


def drift(model_dir: Path, run_dir: Path, draft: str, eval_prompts: int) -> Drift:
    """:class:`Drift` of the run in ``run_dir`` started from ``model_dir``; ``draft``: the
    policy's module that drafts (``draft``, the adapter, or ``eagle``, the EAGLE-3 head)."""
    cfg = load_config(OVERRIDES)
    tokenizer = load_tokenizer(model_dir)
    task = task_from_config(cfg.task)
    start = load_pretrained(model_dir).eval()
    final = load_pretrained(latest_checkpoint(run_dir / "checkpoints")).eval()
    frozen = copy.deepcopy(final)
    getattr(frozen, draft).load_state_dict(getattr(start, draft).state_dict())
    before, after = (
        held_out_samples(p, cfg, tokenizer, task, eval_prompts) for p in (start, final)
    )
    return Drift(start, final, frozen, before, after, cfg.sampling.temperature)


def drift_figures(prefix: str, before: float, after: float, frozen_after: float) -> dict:
    """A draft's held-out acceptance before the run, after it and, frozen at the start, after it
    (``{prefix}_before``, ...) and the ratio after over before."""
    return {
        f"{prefix}_before": round(before, 4),
        f"{prefix}_after": round(after, 4),
        f"{prefix}_frozen_after": round(frozen_after, 4),
        f"{prefix}_after_rl_over_before": round(after / before, 3),
    }

"""Rollout speed of plain vs self-speculative decoding, with the sources of speed kept apart.

    python -m benchmarks.rollout [--quick] [--json PATH] [--device cpu|cuda]

Two RL-trained models, each trained here with `specrl run` on first use and cached under
runs/bench/ (the RL steps are in the JSON):

  demo        task=reverse (answers of at most 8 tokens), the tiny 4-layer model, 150 RL steps
              with spec=early_exit (so its exit after layer 1 is co-trained).
  scratchpad  task=scratchpad (addition with a worked column-by-column answer, about 70 tokens,
              worded differently from sample to sample), model=small (8 layers, 3.2M parameters,
              exit after layer 2 trained in the warm start), then 60 RL steps of 8 groups with
              the exit co-trained (spec.aux_coef=0.1) and half credit for the final answer's
              matching digits (task.partial_credit=0.5).

Rows (one engine each, all side by side in one process, interleaved epoch by epoch):

  none                  plain decoding: one full forward per token (the baseline of every ratio)
  ngram_prompt          n-gram drafts from the row's own prompt and completion only (what
                        vLLM's built-in `ngram` does)
  ngram_group           + the other completions of the same prompt in the batch (GRPO group)
  ngram_history_first   + earlier completions of the prompt, on a first visit (history empty:
                        it is forgotten before every timed epoch)
  ngram_history_after   + earlier completions, after HISTORY_EPOCHS epochs over the same prompts
                        (answer replay: the timed epochs are visits 3, 4 and 5)
  early_exit            the co-trained early exit drafts k tokens, the full model verifies
  hybrid                n-gram drafts (prompt + group, no history) where a match exists, the
                        early exit elsewhere and after a short match; exact either way

The real-model section (benchmarks/rollout_real.py; `--only real`, `--no-rl` skips its three RL
runs) times SmolLM2-135M-Instruct on word_problems with the trained draft adapter, the policy's
EAGLE-3 head (benchmarks/eagle_rows.py) and adaptive draft lengths; its figures are the `real_*`
keys (the head's: `real_eagle_*`, its chi-square included in `lossless`).

Every engine first runs a warm-up over prompts disjoint from the timed ones (kernels, caches),
except ngram_history_after, whose warm-up is HISTORY_EPOCHS epochs over the timed prompts.
Batch = rows per generate call: 1 = one prompt x 1 sample, otherwise prompts x 8 samples.
`lossless` is true only if, in this same run, every row's complete sampled sequences passed a
chi-square test (p >= 0.01) against the exact plain sampling distribution of a model small
enough to enumerate (temperature 1, and 0.7 with top-p 0.9).
"""

from __future__ import annotations

import copy
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from actors.engines.torch.engine import TorchEngine
from benchmarks import cli, rollout_real
from common import metric_names as mn
from common.config import load_config
from common.config.actor import SpecConfig
from common.model import Transformer, load_pretrained
from common.tasks import PromptPool, task_from_config
from common.tokenizer import Tokenizer, encode_prompt, load_tokenizer
from learner.checkpoint import latest_checkpoint
from testing.lossless_check import (
    ADAPTER_VOCAB,
    peaky_model,
    sequence_pvalue,
    with_adapter,
)

ROOT = Path(__file__).resolve().parent.parent

BATCHES = (1, 8, 32)
GROUP = 8
HISTORY_EPOCHS = 2
PVALUE_MIN = 0.01
# Rows that copy nothing from earlier completions of a prompt.
NO_HISTORY = ("ngram_prompt", "ngram_group", "ngram_history_first", "early_exit", "hybrid")


@dataclass
class Workload:
    label: str
    overrides: list[str]
    """`specrl run` overrides that train the model (task, model, spec)."""
    rl_steps: int
    prompts: int
    """Timed prompts per epoch."""


# The RL runs are the same with --quick (one cached model per workload); --quick times fewer
# prompts, once.
SCRATCHPAD_RL = [
    "task=scratchpad",
    "model=small",
    "spec.exit_layer=2",
    "spec.aux_coef=0.1",
    "learner.groups_per_step=8",
    # Half credit for the final answer's matching digits: the warm start leaves exact answers
    # rare, and GRPO learns nothing from a group whose rewards are all equal.
    "task.partial_credit=0.5",
]


def workloads(quick: bool) -> list[Workload]:
    return [
        Workload("demo", ["spec=early_exit"], 150, 32 if quick else 64),
        Workload("scratchpad", SCRATCHPAD_RL, 60, 4 if quick else 8),
    ]


def methods_for(num_layers: int) -> dict[str, SpecConfig]:
    exit_layer = max(1, num_layers // 4)
    # Fixed draft lengths (adaptive off): these rows measure each drafter as it is; the real
    # model's section (rollout_real.py) has the adaptive rows.
    ngram = SpecConfig(method="ngram", k=8, adaptive=False)
    return {
        "none": SpecConfig(method="none"),
        "ngram_prompt": replace(ngram, ngram_sources="prompt"),
        "ngram_group": replace(ngram, ngram_sources="group"),
        "ngram_history_first": replace(ngram, ngram_sources="history"),
        "ngram_history_after": replace(ngram, ngram_sources="history"),
        "early_exit": SpecConfig(method="early_exit", k=4, exit_layer=exit_layer, adaptive=False),
        "hybrid": SpecConfig(
            method="hybrid", k=4, exit_layer=exit_layer, ngram_sources="group", adaptive=False
        ),
    }


def shown(name: str, spec: SpecConfig) -> str:
    if name == "none":
        return "none"
    extra = f", exit {spec.exit_layer}" if spec.uses_early_exit else ""
    label = {
        "ngram_prompt": "ngram: prompt only",
        "ngram_group": "ngram: + group",
        "ngram_history_first": "ngram: + history, first visit",
        "ngram_history_after": f"ngram: + history, after {HISTORY_EPOCHS} epochs (replay)",
        "early_exit": "early exit",
        "hybrid": "hybrid: ngram (prompt + group), else early exit",
    }[name]
    return f"{label} (k={spec.k}{extra})"


def rl_model(work: Workload) -> Path:
    """The newest checkpoint of a cached `specrl run` with the workload's overrides."""
    run_dir = ROOT / "runs" / "bench" / f"{work.label}-rl-{work.rl_steps}"
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is not None and ckpt.name.endswith(f"{work.rl_steps:08d}"):
        return ckpt
    cmd = [
        sys.executable,
        "-m",
        "ops.cli",
        "run",
        f"run.name=bench-{work.label}-{work.rl_steps}",
        f"run.dir={run_dir}",
        f"run.steps={work.rl_steps}",
        "learner.resume=false",
        *work.overrides,
    ]
    print(f"training the {work.label} model: {' '.join(cmd[2:])} ...", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None, f"no checkpoint in {run_dir}"
    return ckpt


@dataclass
class Timing:
    """One engine's epochs of one row at one batch size."""

    engine: TorchEngine
    epochs: list[dict[str, float]] = field(default_factory=list)

    def median(self, key: str) -> float:
        return statistics.median(e.get(key, float("nan")) for e in self.epochs)


def chunks_of(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    per = 1 if batch == 1 else max(1, batch // GROUP)
    return [prompts[i : i + per] for i in range(0, len(prompts), per)]


def epoch(engine: TorchEngine, chunks: list[list[list[int]]], n: int, max_new: int) -> None:
    for chunk in chunks:
        engine.generate(chunk, n, max_new)


def measure_batch(
    model: Transformer,
    methods: dict[str, SpecConfig],
    timed: list[list[int]],
    warm: list[list[int]],
    batch: int,
    max_new: int,
    repeats: int,
    tokenizer: Tokenizer,
) -> dict[str, Timing]:
    """Every row at one batch size; the timed epochs of the rows alternate, so a change in the
    machine's load hits every row alike."""
    n = 1 if batch == 1 else GROUP
    timed_chunks, warm_chunks = chunks_of(timed, batch), chunks_of(warm, batch)
    timings = {}
    for name, spec in methods.items():
        engine = TorchEngine(model, tokenizer.eos_id, tokenizer.pad_id, 1.0, seed=0, spec=spec)
        epoch(engine, warm_chunks, n, max_new)
        if name == "ngram_history_after":
            for _ in range(HISTORY_EPOCHS):
                epoch(engine, timed_chunks, n, max_new)
        engine.stats()
        timings[name] = Timing(engine)
    for _ in range(repeats):
        for name, timing in timings.items():
            if name == "ngram_history_first":
                assert timing.engine.ngram is not None
                timing.engine.ngram.forget()
            epoch(timing.engine, timed_chunks, n, max_new)
            timing.epochs.append(timing.engine.stats())
    return timings


def run_workload(
    work: Workload, device: torch.device, repeats: int, batches: tuple[int, ...]
) -> tuple[dict[str, float], list[str]]:
    ckpt = rl_model(work)
    model = load_pretrained(ckpt, device=device).eval()
    tokenizer = load_tokenizer(ckpt)
    cfg = load_config(work.overrides)
    task = task_from_config(cfg.task)
    assert isinstance(task, PromptPool)
    # Prompts of the RL training set (as in a later epoch of the run), warm-up ones disjoint.
    pool = list(task.problems)
    random.Random(1).shuffle(pool)
    unique = list({p.prompt_id: p for p in pool}.values())
    timed_problems = unique[: work.prompts]
    timed = [encode_prompt(tokenizer, p.prompt) for p in timed_problems]
    warm = [encode_prompt(tokenizer, p.prompt) for p in unique[work.prompts : work.prompts + 8]]
    methods = methods_for(model.args.num_hidden_layers)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    title = (
        f"{work.label}, RL-trained ({params:.1f}M params, {model.args.num_hidden_layers} "
        f"layers, {work.rl_steps} RL steps)"
    )
    print(f"\n### {title}\n", flush=True)
    flat: dict[str, float] = {
        f"{work.label}_params_m": round(params, 2),
        f"{work.label}_layers": model.args.num_hidden_layers,
        f"{work.label}_rl_steps": work.rl_steps,
        f"{work.label}_timed_prompts": len(timed),
        f"{work.label}_reward": round(
            sampled_reward(model, task, timed_problems, tokenizer, device), 3
        ),
    }
    rows = []
    for batch in batches:
        timings = measure_batch(
            model, methods, timed, warm, batch, task.max_new_tokens, repeats, tokenizer
        )
        base = timings["none"]
        base_speed = base.median(mn.ACTOR_TOKENS_PER_S)
        base_fwd_s = base.median(mn.ACTOR_GEN_TIME_S) / base.median(mn.ACTOR_FORWARD_PASSES)
        flat[f"{work.label}_mean_completion_tokens"] = round(
            base.median(mn.ACTOR_TOKENS) / (len(timed) * (1 if batch == 1 else GROUP)), 1
        )
        for name, timing in timings.items():
            key = f"{work.label}_{name}_b{batch}"
            speed = timing.median(mn.ACTOR_TOKENS_PER_S)
            flat[f"{key}_tokens_per_s"] = round(speed, 1)
            flat[f"{key}_speedup"] = round(speed / base_speed, 3)
            if name == "none":
                rows.append(f"| {title} | {batch} | none | {speed:,.0f} | 1.00x | – | – | – | – |")
                continue
            fwd_s = timing.median(mn.ACTOR_GEN_TIME_S) / timing.median(mn.ACTOR_FORWARD_PASSES)
            figures = {
                "acceptance": timing.median(mn.SPEC_ACCEPTANCE_RATE),
                "mean_accepted_len": timing.median(mn.SPEC_MEAN_ACCEPTED_LEN),
                "forwards_per_token": timing.median(mn.SPEC_FORWARDS_PER_TOKEN),
                # Wall time per verify step (drafting included) over a plain decode step's.
                "step_cost_vs_decode": fwd_s / base_fwd_s,
            }
            for i in range(1, methods[name].k + 1):
                figures[f"acceptance_pos{i}"] = timing.median(f"{mn.SPEC_ACCEPTANCE_POS_PREFIX}{i}")
            for fig, value in figures.items():
                flat[f"{key}_{fig}"] = round(value, 3)
            rows.append(
                f"| {title} | {batch} | {shown(name, methods[name])} | {speed:,.0f} | "
                f"{speed / base_speed:.2f}x | {figures['acceptance']:.2f} | "
                f"{figures['mean_accepted_len']:.2f} | {figures['acceptance_pos1']:.2f} | "
                f"{figures['step_cost_vs_decode']:.2f} |"
            )
        for row in rows[-len(timings) :]:
            print(row, flush=True)
    return flat, rows


@torch.no_grad()
def sampled_reward(model, task, problems, tokenizer, device) -> float:
    """Mean reward of 8 plain samples per timed prompt (what the RL run reached)."""
    engine = TorchEngine(model, tokenizer.eos_id, tokenizer.pad_id, 1.0, seed=99)
    rewards = []
    for problem in problems:
        for rollout in engine.generate(
            [encode_prompt(tokenizer, problem.prompt)], GROUP, task.max_new_tokens
        )[0]:
            ids = [t for t in rollout.token_ids.tolist() if t != tokenizer.eos_id]
            rewards.append(task.reward(problem, tokenizer.decode(ids)))
    return sum(rewards) / len(rewards)


def lossless_check(quick: bool) -> tuple[bool, dict[str, float]]:
    """Every row's sampled sequences against the exact plain distribution (chi-square)."""
    model = peaky_model(vocab=6, seed=1, scale=8.0, layers=4)
    adapter = copy.deepcopy(model)
    adapter_spec = SpecConfig(method="early_exit", exit_layer=1, adapter=True)
    with_adapter(adapter, adapter_spec, ADAPTER_VOCAB)
    rows = {
        **{name: (model, spec) for name, spec in methods_for(4).items()},
        # The real-model section's rows: the adapter draft, fixed and adaptive lengths.
        **{f"real_{name}": (adapter, spec) for name, spec in rollout_real.methods(3, 1).items()},
    }
    pvalues = {}
    for name, (model, spec) in rows.items():
        for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
            engine = TorchEngine(model, 2, 0, temperature, top_p, seed=7, spec=spec)
            if name == "ngram_history_after":
                engine.generate([[1, 4, 5, 4]], 64, 3)  # earlier completions to replay
            p = sequence_pvalue(engine, [1, 4, 5, 4], 3, 2000 if quick else 6000)
            pvalues[f"pvalue_{name}_t{temperature}_p{top_p}"] = p
    return all(p >= PVALUE_MIN for p in pvalues.values()), pvalues


GOALS = (("speedup_b8_best_lossless", 1.5), ("speedup_b8_no_history", 1.2))


def goal_notes(
    flat: dict[str, float],
    speedups: dict[str, float],
    best: str,
    no_history: str,
    lossless: bool,
) -> dict[str, object]:
    """Whether the scratchpad goals are met and, where one is not, what limits it, from the
    figures of this run: a speculative step emits ``mean accepted len`` tokens for
    ``step cost vs decode`` plain steps' time, so its speed-up is about their ratio."""
    out: dict[str, object] = {}
    notes = []
    for (goal, target), method in zip(GOALS, (best, no_history), strict=True):
        met = lossless and speedups[method] >= target
        out[f"goal_{goal}_met"] = met
        if met:
            continue
        key = f"scratchpad_{method}_b8"
        positions = [
            flat[f"{key}_acceptance_pos{i}"]
            for i in range(1, 9)
            if f"{key}_acceptance_pos{i}" in flat
        ]
        notes.append(
            f"{goal} = {speedups[method]:.2f} < {target} ({method}): acceptance "
            f"{flat[f'{key}_acceptance']:.2f}, by draft position {positions}, mean accepted "
            f"length {flat[f'{key}_mean_accepted_len']:.2f} tokens per verify step, and a verify "
            f"step (drafting included) takes {flat[f'{key}_step_cost_vs_decode']:.2f}x a plain "
            f"decode step."
        )
    out["note"] = " ".join(notes) if notes else "both batch-8 goals met"
    return out


def provenance() -> dict[str, object]:
    """The command, commit and worktree state (:func:`cli.provenance`), the machine and versions."""
    cpu = cli.cpu_model()
    return {
        **cli.provenance(),
        "machine": f"{os.cpu_count()} CPUs, {cpu}, {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": list(os.getloadavg()),
    }


def headlines(flat: dict[str, float], lossless: bool) -> dict[str, object]:
    """Per workload (demo, scratchpad), the best lossless speed-up at batch 8, the best without
    history, and the prompt + group n-gram's; the scratchpad's goal notes."""
    summary: dict[str, object] = {}
    for label in ("demo", "scratchpad"):
        speedups = {
            k.removeprefix(f"{label}_").removesuffix("_b8_speedup"): v
            for k, v in flat.items()
            if k.startswith(f"{label}_") and k.endswith("_b8_speedup") and "_none_" not in k
        }
        if not speedups:
            continue
        best = max(speedups, key=speedups.__getitem__)
        no_history = max((m for m in speedups if m in NO_HISTORY), key=speedups.__getitem__)
        prefix = "" if label == "scratchpad" else f"{label}_"
        summary[f"{prefix}speedup_b8_best_lossless"] = speedups[best] if lossless else 0.0
        summary[f"{prefix}best_method_b8"] = best
        summary[f"{prefix}speedup_b8_no_history"] = speedups[no_history] if lossless else 0.0
        summary[f"{prefix}no_history_method_b8"] = no_history
        summary[f"{prefix}speedup_b8_ngram_prompt_group"] = speedups["ngram_group"]
        if label == "scratchpad":
            summary.update(goal_notes(flat, speedups, best, no_history, lossless))
    return summary


def main() -> int:
    parser = cli.parser(__doc__)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer prompts, one timed epoch, shorter RL runs (a few minutes once cached)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--no-rl",
        action="store_true",
        help="real model: skip the three 20-step RL runs (end to end, draft acceptance drift)",
    )
    parser.add_argument("--only", choices=("demo", "scratchpad", "real"), help="one workload only")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(opts.device)
    started = time.perf_counter()
    quick = opts.quick
    info = provenance()

    lossless, pvalues = lossless_check(quick)
    print(
        f"lossless (chi-square p >= {PVALUE_MIN}, every row, T=1 and T=0.7/top-p 0.9): "
        f"{lossless}  min p = {min(pvalues.values()):.3g}",
        flush=True,
    )
    flat: dict[str, float] = {}
    table = [
        "| model | batch | method | tokens/s | vs none | acceptance | mean accepted len "
        "| acceptance at pos 1 | step cost vs decode |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    print("\n".join(table))
    for work in workloads(quick):
        if opts.only and work.label != opts.only:
            continue
        figures, rows = run_workload(work, device, 1 if quick else 3, BATCHES)
        flat.update(figures)
        table += rows
    real_table: list[str] = []
    if opts.only in (None, "real"):
        real, real_table = rollout_real.section(quick, 1 if quick else 3, not opts.no_rl)
        flat.update(real)
        # Every row's samples: the EAGLE-3 rows' check runs in the real section.
        lossless = lossless and bool(real["real_eagle_lossless"])

    summary: dict[str, object] = {
        "lossless": lossless,
        "min_pvalue": min(pvalues.values()),
        "history_epochs": HISTORY_EPOCHS,
        "device": str(device),
        "quick": quick,
    }
    summary.update(headlines(flat, lossless))
    summary.update(
        {
            **info,
            "loadavg_end": list(os.getloadavg()),
            "seconds": round(time.perf_counter() - started, 1),
            "table": table,
            "real_table": rollout_real.TABLE_HEAD + real_table if real_table else [],
            **pvalues,
            **flat,
        }
    )
    print()
    for key, method in (
        ("speedup_b8_best_lossless", "best_method_b8"),
        ("speedup_b8_no_history", "no_history_method_b8"),
    ):
        if key in summary:
            print(f"{key} = {summary[key]} ({summary[method]})")
    print(f"lossless = {lossless}, {summary['seconds']} s")
    status = cli.finish(summary, opts.json)
    return 1 if "real_rl_error" in flat else status


if __name__ == "__main__":
    sys.exit(main())

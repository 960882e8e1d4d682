"""Continuous vs static batching in the torch engine, side by side in one run.

    python -m benchmarks.batching [--json PATH] [--prompts N] [--repeats R] [--device cpu|cuda]

Workload: the RL-trained `scratchpad` model of benchmarks/rollout.py (task=scratchpad,
model=small; trained with `specrl run` on first use and cached under runs/bench/), sampling at
temperature 1 from prompts of its training set. Completions are worked additions of about 60 to
110 tokens whose length varies from sample to sample: in a static batch the rows that finish
early leave the batch and the batch shrinks until its longest row is done.

Two engines per decoding method, run alternately (epoch by epoch, so a change in the machine's
load hits both alike), each with at most ROWS = 32 completions decoded at once:

  static      `generate` on 4 prompts x 8 completions at a time (static_batching=True);
              every completion is admitted at once with KV slots reserved for the longest
              prompt + the whole budget (+ k + 1 draft slots); the call returns, and its groups
              go out, when its slowest row is done.
  continuous  one `generate` over all prompts with max_rows = 32: a finished row's KV blocks go
              back to the pool and the next completion takes its place in the next step; a
              group is handed over (on_group) as soon as its 8 completions are done.

Figures (per method; the headline ones are for plain decoding, `spec=none`):

  tokens_per_s_*                 generated tokens / wall time of the epoch (median over epochs)
  kv_peak_bytes_*                the most bytes the KV pool held (it grows by the blocks of
                                 8 slots it lacks, at least 4, and never shrinks)
  group_latency_p50/p95_s_*      per group: from the admission of its first completion to its
                                 hand-over (static: the whole call)
  reward_*                       mean task reward of the completions (the same policy either way)
  forward_passes_*               model forwards (prefills + decoding steps); static / continuous
                                 is the speed-up where a forward costs the same whatever the rows
                                 in it (launch-bound hardware); on a compute-bound CPU both modes
                                 do about the same arithmetic per token

Ratios are printed, never asserted: wall-clock speed depends on the machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.engines.torch.engine import TorchEngine
from benchmarks import cli
from benchmarks.rollout import provenance, rl_model, workloads
from common import metric_names as mn
from common.config import load_config
from common.config.actor import SpecConfig
from common.model import load_pretrained
from common.tasks import PromptPool, task_from_config
from common.tokenizer import encode_prompt, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent

ROWS = 32
GROUP = 8
METHODS = {
    "none": SpecConfig(method="none"),
    # The actor's default drafter (spec=ngram): the prompt, the group, earlier completions.
    "ngram": SpecConfig(method="ngram", adaptive=False),
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    at = (len(ordered) - 1) * q
    lo, hi = int(at), min(int(at) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


class Mode:
    """One engine and its epochs."""

    def __init__(self, name: str, engine: TorchEngine) -> None:
        self.name = name
        self.engine = engine
        self.speeds: list[float] = []
        self.latencies: list[float] = []
        self.tokens = 0
        self.rewards: list[float] = []
        self.forwards = 0

    def epoch(self, prompts, problems, task, tokenizer, max_new: int, record: bool) -> None:
        engine = self.engine
        started_at: dict[int, float] = {}
        delivered: dict[int, float] = {}
        rollouts: dict[int, list] = {}

        def on_group(i: int, group: list, offset: int = 0) -> None:
            delivered[offset + i] = time.perf_counter()
            rollouts[offset + i] = group

        started = time.perf_counter()
        if self.name == "static":
            per_call = ROWS // GROUP
            for at in range(0, len(prompts), per_call):
                call_started = time.perf_counter()
                chunk = prompts[at : at + per_call]
                for i in range(len(chunk)):
                    started_at[at + i] = call_started
                engine.generate(
                    chunk,
                    GROUP,
                    max_new,
                    on_group=lambda i, g, at=at: on_group(i, g, at),
                )
        else:
            engine.admission_log, engine.max_rows = started_at, ROWS
            engine.generate(prompts, GROUP, max_new, on_group=on_group)
            engine.admission_log = None
        wall = time.perf_counter() - started
        forwards = engine.stats()[mn.ACTOR_FORWARD_PASSES]
        tokens = sum(len(r.token_ids) for g in rollouts.values() for r in g)
        if not record:
            return
        self.speeds.append(tokens / wall)
        self.tokens += tokens
        self.forwards += int(forwards)
        self.latencies += [delivered[i] - started_at[i] for i in delivered]
        for i, group in rollouts.items():
            for r in group:
                ids = [t for t in r.token_ids.tolist() if t != tokenizer.eos_id]
                self.rewards.append(task.reward(problems[i], tokenizer.decode(ids)))


def compare_batching(label: str, spec: SpecConfig, model, prompts: Prompts, repeats: int) -> dict:
    """Static and continuous batching with the drafter ``spec``: their figures (keys suffixed
    with ``label`` unless it is "none") and the Markdown table rows."""
    tokenizer, task = prompts.tokenizer, prompts.task
    modes = [
        Mode(
            name,
            TorchEngine(
                model,
                tokenizer.eos_id,
                tokenizer.pad_id,
                1.0,
                seed=s,
                spec=spec,
                static_batching=name == "static",
            ),
        )
        for s, name in enumerate(("static", "continuous"))
    ]
    for mode in modes:
        mode.epoch(prompts.warm, prompts.warm_problems, task, tokenizer, prompts.max_new, False)
        mode.engine.cache.peak_bytes = mode.engine.cache.bytes()  # warm-up pool counts
    for _ in range(repeats):
        for mode in modes:
            if mode.engine.ngram is not None:
                mode.engine.ngram.forget()  # every epoch is a first visit of its prompts
            mode.epoch(
                prompts.timed, prompts.timed_problems, task, tokenizer, prompts.max_new, True
            )
    out: dict[str, object] = {"rows": []}
    for mode in modes:
        key = f"{mode.name}" if label == "none" else f"{mode.name}_{label}"
        speed = statistics.median(mode.speeds)
        p50, p95 = percentile(mode.latencies, 0.5), percentile(mode.latencies, 0.95)
        peak = mode.engine.cache.peak_bytes
        reward = sum(mode.rewards) / len(mode.rewards)
        out[f"tokens_per_s_{key}"] = round(speed, 1)
        out[f"kv_peak_bytes_{key}"] = peak
        out[f"group_latency_p50_s_{key}"] = round(p50, 3)
        out[f"group_latency_p95_s_{key}"] = round(p95, 3)
        out[f"reward_{key}"] = round(reward, 4)
        out[f"forward_passes_{key}"] = mode.forwards
        out[f"mean_completion_tokens_{key}"] = round(
            mode.tokens / (len(mode.speeds) * len(prompts.timed) * GROUP), 1
        )
        out["rows"].append(
            f"| {label} | {mode.name} | {speed:,.0f} | {peak / 2**20:.2f} | "
            f"{p50:.2f} / {p95:.2f} | {reward:.3f} |"
        )
        print(out["rows"][-1], flush=True)
    suffix = "" if label == "none" else f"_{label}"
    out[f"tokens_per_s_continuous_over_static{suffix}"] = round(
        statistics.median(modes[1].speeds) / statistics.median(modes[0].speeds), 3
    )
    # What the speed ratio would be if a forward cost the same whatever the rows in it (a
    # launch-bound accelerator); on a compute-bound CPU the two do the same arithmetic.
    out[f"forward_passes_static_over_continuous{suffix}"] = round(
        out[f"forward_passes_static{suffix}"] / out[f"forward_passes_continuous{suffix}"], 3
    )
    out[f"kv_peak_bytes_dynamic_over_static{suffix}"] = round(
        out[f"kv_peak_bytes_continuous{suffix}"] / out[f"kv_peak_bytes_static{suffix}"], 3
    )
    return out


@dataclass
class Prompts:
    """The timed and warm-up prompts of the scratchpad task, encoded."""

    task: PromptPool
    tokenizer: object
    timed_problems: list
    warm_problems: list
    timed: list[list[int]]
    warm: list[list[int]]
    max_new: int


def main() -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--prompts", type=int, default=32, help="timed prompts per epoch")
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per engine")
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(opts.device)
    info = provenance()
    started = time.perf_counter()

    work = next(w for w in workloads(False) if w.label == "scratchpad")
    ckpt = rl_model(work)
    model = load_pretrained(ckpt, device=device).eval()
    tokenizer = load_tokenizer(ckpt)
    task = task_from_config(load_config(work.overrides).task)
    assert isinstance(task, PromptPool)
    pool = list({p.prompt_id: p for p in task.problems}.values())
    timed_problems = pool[: opts.prompts]
    warm_problems = pool[opts.prompts : opts.prompts + ROWS // GROUP]
    prompts = Prompts(
        task,
        tokenizer,
        timed_problems,
        warm_problems,
        [encode_prompt(tokenizer, p.prompt) for p in timed_problems],
        [encode_prompt(tokenizer, p.prompt) for p in warm_problems],
        task.max_new_tokens,
    )
    summary: dict[str, object] = {
        "workload": "task=scratchpad model=small, RL-trained "
        f"({work.rl_steps} steps, {ckpt.relative_to(ROOT)}), temperature 1",
        "rows": ROWS,
        "group_size": GROUP,
        "timed_prompts": len(prompts.timed),
        "repeats": opts.repeats,
        "max_new_tokens": prompts.max_new,
        "device": str(device),
        "dtype": str(next(model.parameters()).dtype),
    }
    lines = [
        "| method | batching | tokens/s | KV peak (MiB) | group latency p50 / p95 (s) | reward |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for label, spec in METHODS.items():
        figures = compare_batching(label, spec, model, prompts, opts.repeats)
        lines += figures.pop("rows")
        summary |= figures
    summary |= {**info, "table": lines}
    print()
    print("\n".join(lines))
    for key in (
        "tokens_per_s_continuous_over_static",
        "kv_peak_bytes_dynamic_over_static",
        "forward_passes_static_over_continuous",
        "tokens_per_s_continuous_over_static_ngram",
        "kv_peak_bytes_dynamic_over_static_ngram",
    ):
        print(f"{key} = {summary[key]}")
    return cli.finish(summary, opts.json, started)


if __name__ == "__main__":
    sys.exit(main())

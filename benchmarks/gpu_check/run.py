"""The GPU check's driver: the stages in order, the JSON rewritten after each."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import cli
from benchmarks.gpu_check.engine_stage import (
    engine_rows,
    lossless,
    structure,
    summarise,
)
from benchmarks.gpu_check.learner_stage import (
    environment,
    learner_step,
)
from benchmarks.gpu_check.plan import (
    CPU_PLAN,
    GPU_PLAN,
    ROOT,
    Run,
    free_memory,
)
from benchmarks.gpu_check.weights_stage import weight_sync

# ------------------------------------------------------------------------------ main


def default_json(cpu: bool) -> Path:
    name = "gpu_cpu.json" if cpu else "gpu.json"
    out = os.environ.get("OUT")
    return Path(out) / name if out else ROOT / "benchmarks" / "results" / name


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (CI)")
    p.add_argument(
        "--budget-s",
        type=float,
        help="seconds after which engine batch sizes above 8 are skipped (default: 420, --cpu 240)",
    )
    opts = p.parse_args(argv)
    if opts.budget_s is not None and opts.budget_s <= 0:
        p.error(f"--budget-s must be > 0, got {opts.budget_s}")
    if not opts.cpu and not torch.cuda.is_available():
        p.error("no CUDA device here: run on the GPU machine, or with --cpu")
    plan = CPU_PLAN if opts.cpu else GPU_PLAN
    if opts.budget_s is not None:
        plan = replace(plan, budget_s=opts.budget_s)
    device = torch.device("cpu" if opts.cpu else "cuda")
    if opts.cpu:
        torch.set_num_threads(1)  # tiny shapes: more threads only contend
    run = Run(opts.json or default_json(opts.cpu), plan.budget_s)
    run.say("gpu-check", f"{'cpu' if opts.cpu else 'gpu'} mode, JSON -> {run.path}")
    run.stage("environment", lambda: environment(plan, device, "cpu" if opts.cpu else "gpu"))
    shared: dict[str, Any] = {}

    def learner() -> dict[str, Any]:
        figures, shared["source"] = learner_step(plan, device, run)
        return figures

    run.stage("learner", learner)
    free_memory()
    run.stage("weights", lambda: weight_sync(plan, device, run, shared.pop("source", None)))
    free_memory()
    run.stage("lossless", lambda: lossless(plan, device, run))
    built: dict[str, Any] = {}

    def build() -> dict[str, Any]:
        figures, built["model"], built["chain"] = structure(plan, device, run)
        return figures

    if run.stage("structure", build):
        run.stage("engine", lambda: engine_rows(plan, device, run, built["model"], built["chain"]))
    run.figures.update(summarise(run.figures))
    run.write()
    headline = {
        k: run.figures.get(k)
        for k in (
            "gpu_speedup_b8_best_lossless",
            "gpu_best_method_b8",
            "gpu_adaptive_min_ratio",
            "gpu_tokens_per_verify_b8",
            "gpu_eagle_tokens_per_verify_b8",
            "gpu_eagle3_b8_ratio",
            "learner_step_s",
            "weights_publish_gbps",
            "weights_fetch_gbps",
        )
    }
    run.say("gpu-check", f"{json.dumps(headline)}; errors: {len(run.errors)}")
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())

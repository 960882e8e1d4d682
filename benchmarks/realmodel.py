"""A real pretrained model end to end: SmolLM2-135M-Instruct (``model=smollm2-135m``) learning
``task=word_problems`` with ``specrl run``, measured.

    python -m benchmarks.realmodel [--json PATH] [--minutes 30] [--eval-problems 200]

1. Builds the preset's HF directory if needed (``runs/models/smollm2-135m``).
2. Evaluates it on the held-out set (``common.word_problems.eval_problems``: none of its prompts is
   in the training pool), ``--eval-samples`` completions per problem at the preset's sampling
   settings, on the torch engine.
3. Runs ``specrl run model=smollm2-135m task=word_problems run.max_wall_s=MINUTES*60`` (torch
   engine, one actor) while sampling the resident (RSS) and proportional (PSS: shared pages split
   between the processes that map them) memory of every process of the run once a second.
4. Evaluates the run's final checkpoint on the same problems with the same seeds: the gain is the
   mean of per-problem differences, with a 95% normal interval over problems (paired).
5. Opens that checkpoint in ``transformers`` and in vLLM and compares their greedy completions.
6. Runs the same preset on ``engine=vllm`` for a few steps (its actor's tokens/s), when vLLM is
   installed: the preset as it is, so the trained draft adapter drafts there too.

Figures: ``realmodel_eval_before``, ``realmodel_eval_after``, ``realmodel_eval_gain`` (+
``_ci95``), ``realmodel_reward_by_quarter``, ``realmodel_peak_rss_gb`` (per process) and
``realmodel_peak_rss_gb_total`` (+ the PSS sums), ``realmodel_publish_s``, ``realmodel_fetch_s``,
``realmodel_actor_tokens_per_s`` (per engine), ``realmodel_ckpt_greedy_match``; what drafted:
``realmodel_spec`` / ``realmodel_vllm_spec`` (the method each run's config resolves to:
``spec=adapter`` is ``auto``, hybrid on the torch engine and the adapter alone on vLLM),
``realmodel_draft`` / ``realmodel_vllm_draft`` (which draft: the trained adapter, an untrained
one, the bare early exit, n-gram) and their ``..._spec_acceptance_rate``; ``commit``, ``dirty``
and ``command`` (``benchmarks/cli.py``).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from benchmarks import cli
from benchmarks.procstat import descendants
from common import metric_names as mn
from common.config import load_config

ROOT = Path(__file__).resolve().parent.parent

PRESET = ["model=smollm2-135m", "task=word_problems"]
KINDS = {
    "learner": re.compile(r"-m learner\.main"),
    "actor": re.compile(r"-m actors\.main"),
    "upload": re.compile(r"multiprocessing\.spawn|-B -c from multiprocessing"),
    "redis": re.compile(r"redis-server"),
}


class MemorySampler:
    """Peak RSS and PSS (GB) of every process under ``root_pid``, by kind, sampled each second."""

    def __init__(self, root_pid: int, interval_s: float = 1.0) -> None:
        self.root = root_pid
        self.interval_s = interval_s
        self.peaks: dict[str, dict[str, float]] = {}
        self._total_pss = 0.0
        self._total_rss = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        rss_sum = pss_sum = 0.0
        for pid in descendants(self.root):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
            except OSError:
                continue
            kind = next((k for k, pattern in KINDS.items() if pattern.search(cmd)), None)
            if kind is None:
                continue
            fields = dict(re.findall(r"^(Rss|Pss):\s+(\d+) kB", rollup, re.M))
            rss, pss = int(fields.get("Rss", 0)) / 2**20, int(fields.get("Pss", 0)) / 2**20
            name = f"{kind}-{pid}" if kind == "actor" else kind
            peak = self.peaks.setdefault(name, {"rss": 0.0, "pss": 0.0})
            peak["rss"], peak["pss"] = max(peak["rss"], rss), max(peak["pss"], pss)
            rss_sum, pss_sum = rss_sum + rss, pss_sum + pss
        self._total_rss = max(self._total_rss, rss_sum)
        self._total_pss = max(self._total_pss, pss_sum)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def close(self) -> dict[str, object]:
        self._stop.set()
        self._thread.join()
        return {
            "realmodel_peak_rss_gb": {k: round(v["rss"], 2) for k, v in self.peaks.items()},
            "realmodel_peak_pss_gb": {k: round(v["pss"], 2) for k, v in self.peaks.items()},
            # Sum of each process's own peak (an upper bound on the run's peak).
            "realmodel_peak_rss_gb_total": round(sum(v["rss"] for v in self.peaks.values()), 2),
            "realmodel_peak_pss_gb_total": round(sum(v["pss"] for v in self.peaks.values()), 2),
            # The largest sum seen at one instant.
            "realmodel_peak_rss_gb_simultaneous": round(self._total_rss, 2),
            "realmodel_peak_pss_gb_simultaneous": round(self._total_pss, 2),
        }


def evaluate(
    model_dir: Path, problems, samples: int, temperature: float, max_new_tokens: int, seed: int
) -> list[float]:
    """Per problem, the fraction of ``samples`` completions the task rewards (torch engine, the
    published dtype the actors decode in: bf16)."""
    from actors.engines.torch.engine import TorchEngine
    from common.config.actor import SpecConfig
    from common.model import load_pretrained
    from common.tokenizer import HFTokenizer
    from common.word_problems import WordProblemsTask

    tokenizer = HFTokenizer(model_dir)
    model = load_pretrained(model_dir, dtype=torch.bfloat16)
    engine = TorchEngine(
        model,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        temperature=temperature,
        seed=seed,
        spec=SpecConfig(method="none"),
        max_rows=32,
    )
    task = WordProblemsTask()
    prompts = [tokenizer.encode_chat(p.prompt) for p in problems]
    scores: list[float] = []
    started = time.perf_counter()
    for i in range(0, len(problems), 8):
        results = engine.generate(prompts[i : i + 8], samples, max_new_tokens)
        for problem, rollouts in zip(problems[i : i + 8], results, strict=True):
            texts = [
                tokenizer.decode([t for t in r.token_ids.tolist() if t != tokenizer.eos_id])
                for r in rollouts
            ]
            scores.append(sum(task.reward(problem, t) for t in texts) / len(texts))
        print(
            f"  eval {len(scores)}/{len(problems)} accuracy {statistics.fmean(scores):.3f} "
            f"({time.perf_counter() - started:.0f}s)",
            flush=True,
        )
    return scores


def paired_gain(before: list[float], after: list[float]) -> tuple[float, list[float]]:
    """Mean per-problem gain and its 95% normal interval."""
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("inf")
    return mean, [mean - 1.96 * se, mean + 1.96 * se]


def by_quarter(rows: list[dict]) -> list[dict[str, float]]:
    """Mean training reward (and its standard error over steps) per quarter of the run."""
    rewards = [r[mn.LEARNER_REWARD_MEAN] for r in rows]
    out = []
    for q in range(4):
        part = rewards[q * len(rewards) // 4 : (q + 1) * len(rewards) // 4]
        if not part:
            continue
        se = statistics.stdev(part) / math.sqrt(len(part)) if len(part) > 1 else 0.0
        out.append(
            {"mean": round(statistics.fmean(part), 4), "se": round(se, 4), "steps": len(part)}
        )
    return out


def specrl_run(overrides: list[str], run_name: str, timeout_s: float) -> tuple[Path, dict]:
    """``specrl run`` with ``overrides``; its run directory and the memory peaks."""
    cmd = [sys.executable, "-m", "ops.cli", "run", *overrides, f"run.name={run_name}"]
    print("$ specrl " + " ".join(cmd[3:]), flush=True)
    # Dumpable: the learner and actors close /proc/<pid>/smaps_rollup to other processes
    # otherwise (common/entrypoint.py), and this benchmark samples their memory there.
    env = os.environ | {"PYTHONPATH": str(ROOT), "SPECRL_DUMPABLE": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    sampler = MemorySampler(proc.pid)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        code = proc.wait()
    memory = sampler.close()
    if code != 0:
        raise SystemExit(f"specrl run exited with {code}")
    return ROOT / "runs" / run_name, memory


def metric_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if mn.LEARNER_STEP in r and "event" not in r]


def final_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step_*"))[-1]


def greedy_match(ckpt: Path, prompts: list[str], max_new_tokens: int) -> dict[str, object]:
    """Greedy completions of the checkpoint in ``transformers`` and in vLLM, token for token."""
    from transformers import AutoModelForCausalLM

    from common.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(ckpt)
    ids = [tokenizer.encode_chat(p) for p in prompts]
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    hf = []
    for row in ids:
        out = model.generate(
            torch.tensor([row]),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_id,
            eos_token_id=tokenizer.eos_id,
        )
        hf.append(out[0, len(row) :].tolist())
    del model
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outs = llm.generate([TokensPrompt(prompt_token_ids=row) for row in ids], params)
    vl = [list(o.outputs[0].token_ids) for o in outs]
    matches = [a == b for a, b in zip(hf, vl, strict=True)]
    return {
        "realmodel_ckpt_greedy_match": all(matches),
        "realmodel_ckpt_greedy_matches": f"{sum(matches)}/{len(matches)}",
        "realmodel_ckpt_greedy_example": tokenizer.decode(hf[0]),
    }


def draft_used(overrides: list[str]) -> dict[str, object]:
    """The drafting a ``specrl run`` with ``overrides`` uses, as its config resolves it
    (``spec.method=auto`` per engine): ``spec`` (the method) and ``draft`` (which draft)."""
    from common.model import DRAFT_FILE

    cfg = load_config(overrides)
    spec = cfg.spec
    if spec.method == "none":
        draft = "none (plain decoding)"
    elif spec.adapter:
        trained = (Path(cfg.model.path) / DRAFT_FILE).is_file()
        draft = (
            f"the trained draft adapter ({DRAFT_FILE} of the model directory)"
            if trained
            else f"an untrained draft adapter (a copy of layer {spec.exit_layer})"
        )
    elif spec.uses_early_exit:
        draft = f"the policy's first {spec.exit_layer} layer(s) (early exit, no adapter)"
    else:
        draft = ""
    if spec.uses_ngram:
        draft = " + ".join(x for x in (draft, f"n-gram ({spec.ngram_sources})") if x)
    return {"spec": spec.method, "draft": draft, "adaptive": spec.adaptive, "k": spec.k}


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def vllm_run_figures(opts, run_name: str, tokens_per_s: dict) -> dict[str, object]:
    """A short `specrl run` of the preset on vLLM (``--vllm-steps`` steps): its memory, drafting
    and acceptance; its actor tokens/s goes into ``tokens_per_s`` beside the torch run's."""
    vllm_run = [*PRESET, "engine=vllm", "actor.num_actors=1"]
    vllm_run += [f"run.steps={opts.vllm_steps}", *opts.overrides]
    vllm_dir, vllm_memory = specrl_run(vllm_run, f"{run_name}-vllm", timeout_s=1800)
    vllm_drafting = draft_used(vllm_run)
    vllm_summary = json.loads((vllm_dir / "summary.json").read_text())
    tokens_per_s["vllm"] = vllm_summary.get("actor_tokens_per_s")
    return {
        "realmodel_vllm_peak_rss_gb": vllm_memory["realmodel_peak_rss_gb"],
        "realmodel_vllm_command": "specrl run " + " ".join(vllm_run),
        "realmodel_vllm_spec": vllm_drafting["spec"],
        "realmodel_vllm_draft": vllm_drafting["draft"],
        "realmodel_vllm_spec_acceptance_rate": vllm_summary.get("spec_acceptance_rate"),
    }


def main() -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--minutes", type=float, default=30.0, help="RL wall time")
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--vllm-steps", type=int, default=4, help="0: skip the vLLM run")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for the RL run")
    opts = parser.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(os.cpu_count() or 1)

    from common.tasks import task_from_config
    from common.word_problems import eval_problems
    from learner.prepare.warm_start import ensure_model

    cfg = load_config([*PRESET, *opts.overrides])
    model_dir = ensure_model(cfg)
    pool = task_from_config(cfg.task)
    problems = eval_problems(pool.task, opts.eval_problems, pool.problems)
    temperature, max_new = cfg.sampling.temperature, pool.max_new_tokens
    figures: dict[str, object] = {
        "command": cli.command_line(sys.argv),
        "model": str(model_dir),
        "eval_problems": len(problems),
        "eval_samples": opts.eval_samples,
        "temperature": temperature,
        "max_new_tokens": max_new,
        "cpu_count": os.cpu_count(),
    }
    print(f"evaluating {model_dir} before RL", flush=True)
    before = evaluate(model_dir, problems, opts.eval_samples, temperature, max_new, seed=7)

    run_name = f"realmodel-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = [*PRESET, "actor.num_actors=1", f"run.max_wall_s={opts.minutes * 60:g}"]
    overrides += ["run.steps=100000", *opts.overrides]
    run_dir, memory = specrl_run(overrides, run_name, timeout_s=opts.minutes * 60 + 600)
    drafting = draft_used(overrides)  # after the run: `specrl run` warm-starts a missing draft
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = metric_rows(run_dir)
    ckpt = final_checkpoint(run_dir)
    print(f"evaluating {ckpt} after RL", flush=True)
    after = evaluate(ckpt, problems, opts.eval_samples, temperature, max_new, seed=7)
    gain, interval = paired_gain(before, after)
    publish = [r[mn.LEARNER_PUBLISH_UPLOAD_S] for r in rows if r.get(mn.LEARNER_PUBLISH_UPLOAD_S)]
    fetch = [r[mn.ACTOR_WEIGHT_FETCH_S] for r in rows if r.get(mn.ACTOR_WEIGHT_FETCH_S)]
    figures |= {
        "realmodel_eval_before": round(statistics.fmean(before), 4),
        "realmodel_eval_after": round(statistics.fmean(after), 4),
        "realmodel_eval_gain": round(gain, 4),
        "realmodel_eval_gain_ci95": [round(x, 4) for x in interval],
        "target_realmodel_eval_gain": 0.05,
        "realmodel_rl_wall_s": summary.get("wall_s"),
        "realmodel_rl_steps": summary.get("steps"),
        "realmodel_reward_by_quarter": by_quarter(rows),
        **memory,
        "target_realmodel_peak_rss_gb_total": 6.0,
        "realmodel_publish_s": round(statistics.median(publish), 2) if publish else None,
        "realmodel_fetch_s": round(statistics.median(fetch), 2) if fetch else None,
        "realmodel_actor_tokens_per_s": {"torch": summary.get("actor_tokens_per_s")},
        "realmodel_rl_summary": summary,
        "realmodel_rl_command": "specrl run " + " ".join(overrides),
        "realmodel_spec": drafting["spec"],
        "realmodel_draft": drafting["draft"],
        "realmodel_spec_acceptance_rate": summary.get("spec_acceptance_rate"),
    }
    figures["target_met"] = (
        gain >= 0.05 and interval[0] > 0 and figures["realmodel_peak_rss_gb_total"] <= 6.0  # type: ignore[operator]
    )
    if vllm_available():
        figures |= greedy_match(ckpt, [p.prompt for p in problems[:4]], 32)
        if opts.vllm_steps:
            figures |= vllm_run_figures(opts, run_name, figures["realmodel_actor_tokens_per_s"])
    status = cli.finish(figures, opts.json, started)
    print(json.dumps(figures, indent=1, default=str))
    return status


if __name__ == "__main__":
    sys.exit(main())

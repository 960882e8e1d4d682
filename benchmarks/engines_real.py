"""The real-model section of benchmarks/engines.py (``--only real``): SmolLM2-135M-Instruct
with its warm-started draft adapter and EAGLE-3 head (benchmarks/rollout_real.py) on vLLM;
benchmarks/engines.py's docstring says what each figure is."""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import torch

from actors.engines.vllm.verify import verified_token_distribution
from benchmarks import engines_eagle
from benchmarks.vllm_kit import (
    BUILTIN_NGRAM,
    GROUP,
    child_speed,
    interleaved,
    make_vllm,
    warmed_chunks,
)
from common import metric_names as mn
from common.config import load_config
from common.config.actor import EngineConfig, SpecConfig
from common.model import Transformer, load_pretrained, save_pretrained
from common.sampling import processed_logprobs
from common.tasks import task_from_config
from common.tokenizer import load_tokenizer
from testing.lossless_check import (
    exact_sequence_logprobs,
    peaky_model,
    perturbed_pair,
    rollouts_pvalue,
)

ROOT = Path(__file__).resolve().parent.parent


REAL_ROWS = ("vllm_plain", "vllm_selfdraft", "vllm_selfdraft_adaptive", "vllm_ngram_adaptive")


def real_engines(rows, k: int):
    """The real-model vLLM engines named in ``rows`` (and the model's settings)."""
    from benchmarks.real_preset import OVERRIDES, real_model_dir

    model_dir = real_model_dir()
    cfg = load_config(OVERRIDES)
    tokenizer = load_tokenizer(model_dir)
    fixed = SpecConfig(method="early_exit", adapter=True, k=k, adaptive=False)
    specs = {
        "vllm_plain": {},
        "vllm_selfdraft": {"spec": fixed},
        "vllm_selfdraft_adaptive": {"spec": SpecConfig(method="early_exit", adapter=True, k=k)},
        "vllm_ngram_adaptive": {"spec": SpecConfig(method="ngram", k=k, ngram_sources="group")},
        "vllm_builtin_ngram": {"speculative_config": BUILTIN_NGRAM},
    }
    engines = {
        row: make_vllm(
            model_dir,
            tokenizer.eos_id,
            2048,
            temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p,
            **specs[row],
        )
        for row in rows
    }
    return engines, cfg, tokenizer


def real_speed(rows, batches, repeats: int, quick: bool, k: int) -> dict[str, float]:
    """Tokens/s of ``rows`` on the real model, chunk by chunk in turn (the first engine moves
    each time); for the self-draft rows also tokens per verify from the proposer's counts."""
    from common.tasks import task_from_config as make_task

    engines, cfg, tokenizer = real_engines(rows, k)
    task = make_task(cfg.task)
    figures: dict[str, float] = {
        "real_vllm_k": k,
        "real_vllm_temperature": cfg.sampling.temperature,
    }
    for batch in batches:
        timed = warmed_chunks(engines, cfg, tokenizer, task, batch, quick)
        base = {n: dict(e.proposer.counts) for n, e in engines.items() if _counts(e)}
        drafting = {n: _draft_seconds(e) for n, e in engines.items()}
        tokens, seconds = interleaved(engines, timed, repeats, task.max_new_tokens)
        for name, engine in engines.items():
            figures[f"real_{name}_b{batch}_tokens_per_s"] = round(tokens[name] / seconds[name], 1)
            stats = engine.stats()
            if mn.SPEC_ACCEPTANCE_RATE in stats and len(engines) == 2:
                figures[f"real_{name}_b{batch}_acceptance"] = round(
                    stats[mn.SPEC_ACCEPTANCE_RATE], 3
                )
            if drafting[name] is not None:
                # The proposer's own time (its draft forwards and bookkeeping) in the row's time.
                figures[f"real_{name}_b{batch}_proposer_frac"] = round(
                    (_draft_seconds(engine) - drafting[name]) / seconds[name], 3
                )
            if name in base:
                now = engine.proposer.counts
                d = {key: now[key] - base[name][key] for key in now}
                if d["verified"]:
                    figures[f"real_{name}_b{batch}_tokens_per_verify"] = round(
                        1 + d["accepted"] / d["verified"], 3
                    )
                    figures[f"real_{name}_b{batch}_acceptance"] = round(
                        d["accepted"] / max(1, d["proposed"]), 3
                    )
        plain = figures[f"real_vllm_plain_b{batch}_tokens_per_s"]
        for name in engines:
            if name != "vllm_plain":
                figures[f"real_{name}_over_vllm_plain_b{batch}"] = round(
                    figures[f"real_{name}_b{batch}_tokens_per_s"] / plain, 3
                )
            print(
                f"| real | {batch} | {name} | {figures[f'real_{name}_b{batch}_tokens_per_s']:,.1f}"
                f" | {figures.get(f'real_{name}_over_vllm_plain_b{batch}', 1.0):.2f}x | "
                f"{figures.get(f'real_{name}_b{batch}_tokens_per_verify', float('nan')):.2f} |",
                flush=True,
            )
    engines.clear()
    gc.collect()
    return figures


def _draft_seconds(engine) -> float | None:
    """Seconds the self-draft proposer has spent in its ``propose`` calls (None: no such one)."""
    return getattr(getattr(engine, "proposer", None), "draft_seconds", None)


def _counts(engine) -> bool:
    return getattr(engine.proposer, "counts", None) is not None


def real_summary(figures: dict, batches) -> dict[str, object]:
    """The headline real-model figures."""
    out: dict[str, object] = {}
    if "real_vllm_selfdraft_over_vllm_plain_b8" in figures:
        out["real_vllm_selfdraft_over_vllm_plain_b8"] = figures[
            "real_vllm_selfdraft_over_vllm_plain_b8"
        ]
        out["real_vllm_tokens_per_verify_b8"] = figures.get(
            "real_vllm_selfdraft_b8_tokens_per_verify", float("nan")
        )
    ratios = [
        figures[f"real_{row}_over_vllm_plain_b{b}"]
        for row in REAL_ROWS
        if row.endswith("_adaptive")
        for b in batches
        if f"real_{row}_over_vllm_plain_b{b}" in figures
    ]
    if ratios:
        out["real_vllm_adaptive_min_ratio"] = min(ratios)
    return out


def real_lossless(quick: bool, temperature: float) -> dict[str, object]:
    """vLLM + self-draft samples at ``temperature`` vs the exact distribution of an enumerable
    model with a perturbed adapter over 5 of its 6 tokens; the negative control hands vLLM's
    rejection sampler a wrong q (the draft's q at temperature 3 while drafts are drawn at
    ``temperature``), and its samples must fail the same test."""
    from testing.lossless_check import ADAPTER_VOCAB, with_adapter

    spec = SpecConfig(method="early_exit", adapter=True, exit_layer=1, k=3, adaptive=False)
    model = with_adapter(peaky_model(6, 1, 6.0), spec, ADAPTER_VOCAB)
    path = Path(tempfile.mkdtemp(prefix="specrl-selfdraft-lossless-"))
    save_pretrained(model, path)
    prompt = [1, 4, 5, 4]
    exact = exact_sequence_logprobs(model, prompt, 3, temperature, 1.0, 99)
    engine = make_vllm(path, 99, 32, spec=spec, temperature=temperature)
    out = []
    for _ in range(15 if quick else 40):
        out += engine.generate([prompt], 100, 3)[0]
    acceptance = engine.stats()[mn.SPEC_ACCEPTANCE_RATE]
    draft = engine.proposer._draft

    def wrong_q(ids, contexts, k):
        proposed, q = draft(ids, contexts, k)
        flat = q.pow(temperature / 3.0)
        return proposed, (flat / flat.sum(-1, keepdim=True)).contiguous()

    engine.proposer._draft = wrong_q
    bad = []
    for _ in range(15 if quick else 40):
        bad += engine.generate([prompt], 100, 3)[0]
    del engine
    gc.collect()
    p, control = rollouts_pvalue(exact, out), possible_pvalue(exact, bad)
    return {
        "real_vllm_lossless_pvalue": round(p, 4),
        "real_vllm_lossless_control_pvalue": round(control, 6),
        "real_vllm_lossless": p >= 0.01 and control < 0.01,
        "real_vllm_lossless_acceptance": round(acceptance, 3),
        "real_vllm_lossless_samples": len(out),
        "real_vllm_lossless_temperature": temperature,
        "real_vllm_lossless_control": "wrong q: the draft's q at temperature 3",
    }


def possible_pvalue(exact: dict, rollouts) -> float:
    """:func:`rollouts_pvalue`, or 0 when a rollout is impossible under ``exact``."""
    if any(tuple(r.token_ids.tolist()) not in exact for r in rollouts):
        return 0.0
    return rollouts_pvalue(exact, rollouts)


def swapped(engine, old: Transformer, new: Transformer, prompts, samples, max_new, poll: int):
    """Completions of ``prompts`` (``samples`` each) started on ``old`` and swapped to ``new``
    (version 1) at the engine's ``poll``-th poll of its weight source."""
    engine.load_weights(0, old.state_dict())
    calls = {"n": 0}

    def source():
        calls["n"] += 1
        return (1, new.state_dict()) if calls["n"] == poll else None

    return engine.generate(prompts, samples, max_new, weight_source=source)


def inflight_tv(old: Transformer, new: Transformer, prompt, temperature, top_p) -> float:
    """Mean total-variation distance between the law of the token verification leaves at one
    position (default record K = 8, :func:`verified_token_distribution`) and the new policy's,
    over the contexts of 0-2 tokens after ``prompt`` weighted by the old policy's probability
    of reaching them (where in-flight tokens come from)."""
    k = EngineConfig().vllm_verify_topk
    total, weight = 0.0, 0.0
    frontier: list[tuple[list[int], float]] = [([], 1.0)]
    with torch.no_grad():
        for _ in range(3):
            grown = []
            for tokens, reach in frontier:
                x = torch.tensor([prompt + tokens])
                p = processed_logprobs(new(x)[0, -1], temperature, top_p)
                q = processed_logprobs(old(x)[0, -1], temperature, top_p)
                verified = verified_token_distribution(p, q, k)
                total += reach * 0.5 * float((verified - p.double().exp()).abs().sum())
                weight += reach
                grown += [(tokens + [t], reach * float(q[t].exp())) for t in range(len(q))]
            frontier = [(t, r) for t, r in grown if r > 1e-6]
    return total / weight


def real_inflight(quick: bool) -> dict[str, object]:
    """Delayed verification on vLLM at temperature 0.7 / top-p 0.9 with the default record
    (``engine.vllm_verify_topk`` = 8): a chi-square of complete sequences after a swap with two
    tokens in flight, on an enumerable model (12 tokens, peaky) swapped to a perturbed copy,
    and its control (the same run scored with vLLM's raw prompt log-probs, i.e. a wrong new
    record); then the same swap on SmolLM2-135M with unchanged weights, where every in-flight
    token must be kept unless the scoring disagrees with vLLM's sampler (49,152 tokens)."""
    from benchmarks.real_preset import OVERRIDES, PRESET, preset_prompts
    from common.model_presets import preset_dir

    temperature, top_p, vocab = 0.7, 0.9, 12
    old, new = perturbed_pair(vocab)
    path = Path(tempfile.mkdtemp(prefix="specrl-inflight-t07-"))
    save_pretrained(old, path)
    prompt = [1, 4, 5, 4]
    exact = exact_sequence_logprobs(new, prompt, 3, temperature, top_p, 99)
    engine = make_vllm(
        path, 99, 32, inflight="verify_on_swap", temperature=temperature, top_p=top_p, version=0
    )
    assert engine.verify_topk == EngineConfig().vllm_verify_topk < vocab
    calls = 15 if quick else 40
    out = [r for _ in range(calls) for r in swapped(engine, old, new, [prompt], 100, 3, 2)[0]]
    stats = engine.stats()
    engine.score_processed = False  # the control: raw prompt log-probs as the new record
    bad = [r for _ in range(calls // 3) for r in swapped(engine, old, new, [prompt], 100, 3, 2)[0]]
    del engine
    gc.collect()
    p, control = possible_pvalue(exact, out), possible_pvalue(exact, bad)
    figures: dict[str, object] = {
        "real_vllm_inflight_pvalue_t07": round(p, 4),
        "real_vllm_inflight_control_pvalue_t07": control,
        "real_vllm_inflight_lossless_t07": p >= 0.01,
        "real_vllm_inflight_samples_t07": len(out),
        "real_vllm_inflight_control": "new policy scored with raw prompt log-probs (wrong record)",
        "real_vllm_inflight_salvaged_t07": round(stats[mn.VERIFY_SALVAGED_FRAC], 3),
        "real_vllm_inflight_salvaged_t07_measured_on": (
            "the chi-square run: 12-token peaky model swapped to a copy with its LM head "
            "perturbed (0.5 std), two of three tokens in flight"
        ),
        "real_vllm_inflight_record_bytes_per_token_t07": round(
            stats[mn.VERIFY_RECORD_BYTES_PER_TOKEN], 1
        ),
    }
    figures["real_vllm_inflight_tv_t07"] = inflight_tv(old, new, prompt, temperature, top_p)
    model_dir = ROOT / preset_dir(PRESET)
    cfg = load_config(OVERRIDES)
    tokenizer = load_tokenizer(model_dir)
    real = load_pretrained(model_dir).eval()
    engine = make_vllm(
        model_dir,
        tokenizer.eos_id,
        2048,
        inflight="verify_on_swap",
        temperature=temperature,
        top_p=top_p,
        version=0,
    )
    task = task_from_config(cfg.task)
    prompts = preset_prompts(cfg, tokenizer, task, 2 if quick else 4, 700)
    swapped(engine, real, real, prompts, GROUP, 24, 9)
    stats = engine.stats()
    del engine
    gc.collect()
    figures["real_vllm_inflight_same_weights_salvaged_t07"] = round(
        stats[mn.VERIFY_SALVAGED_FRAC], 4
    )
    figures["real_vllm_inflight_same_weights_inflight_tokens_t07"] = stats[
        mn.VERIFY_INFLIGHT_TOKENS
    ]
    return figures


def real_section(opts, batches, repeats: int) -> dict[str, object]:
    """The real-model figures (see the module docstring)."""
    rows = tuple(opts.rows.split(",")) if opts.rows else REAL_ROWS
    figures: dict[str, object] = dict(real_speed(rows, batches, repeats, opts.quick, opts.k))
    if opts.speed_only:
        return figures
    figures.update(real_summary(figures, batches))
    # The policy's EAGLE-3 head on vLLM's native proposer, beside its own vllm plain.
    figures.update(engines_eagle.real_speed(opts.quick, batches, repeats, opts.k))
    figures.update(engines_eagle.summary(figures))
    figures.update(real_lossless(opts.quick, figures["real_vllm_temperature"]))
    figures.update(engines_eagle.lossless(opts.quick))
    figures.update(real_inflight(opts.quick))
    child = child_speed("real", ("vllm_plain", "vllm_builtin_ngram"), batches, repeats)
    for b in batches:
        figures[f"real_vllm_builtin_ngram_over_vllm_plain_b{b}"] = child[
            f"real_vllm_builtin_ngram_over_vllm_plain_b{b}"
        ]
        figures[f"real_vllm_builtin_ngram_b{b}_tokens_per_s"] = child[
            f"real_vllm_builtin_ngram_b{b}_tokens_per_s"
        ]
    figures["real_vllm_suffix"] = (
        "not run: vLLM 0.32's suffix method needs arctic-inference, which is not installed"
    )
    return figures

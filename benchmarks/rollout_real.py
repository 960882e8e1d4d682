"""The real-model section of ``benchmarks/rollout.py``: SmolLM2-135M-Instruct (the
``smollm2-135m`` preset) on its task (``word_problems``, chat template) at the preset's
sampling settings, every method side by side in one process, as the torch engine runs it in an
actor (bf16 weights, one thread).

Rows (each its own engine over the same model):

  none              plain decoding, the baseline of every ratio
  adapter           the trained self-draft (the policy's first layers + its adapter, warm-started
                    with ``specrl warm-draft`` on first use), fixed draft length k
  *_adaptive        ``spec.adaptive``: each step picks its draft length (0 = plain) from the
                    measured acceptance by position and the measured cost of a verify step
                    against a plain one: ngram (prompt + group), the untrained early exit
                    (final norm + LM head after the same layer), the adapter, and hybrid
                    (adapter + n-gram drafts, choosing by expected tokens per cost)
  eagle3            the policy's EAGLE-3 head (warm-started with ``specrl warm-draft spec=eagle3``
                    on first use), fixed k; eagle3_adaptive: the same with ``spec.adaptive``
                    (benchmarks/eagle_rows.py: its figures, the real_eagle_* keys)

Batch = rows per generate call: 1 = one prompt x 1 sample, otherwise prompts x 8 samples (a
GRPO group per prompt). Figures: tokens/s (median over timed epochs), tokens per verifier
forward (machine-independent), acceptance by draft position, chosen draft lengths.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import torch

from actors.engines.torch.engine import TorchEngine
from benchmarks import _spec_rows, eagle_rows
from benchmarks.real_preset import (
    E2E_STEPS,
    GROUP,
    OVERRIDES,
    PRESET,
    RL_SUMMARY_KEYS,
    chunks_of,
    drift,
    drift_figures,
    preset_prompts,
    real_model_dir,
    rl_run,
)
from common import metric_names as mn
from common.config import load_config
from common.config.actor import SpecConfig
from common.model import load_pretrained
from common.tasks import PromptPool, task_from_config
from common.tokenizer import load_tokenizer
from learner.prepare.draft_warmup import held_out_acceptance

BATCHES = (1, 8, 32)


def methods(k: int, exit_layer: int) -> dict[str, SpecConfig]:
    fixed = SpecConfig(method="early_exit", k=k, exit_layer=exit_layer, adapter=True)
    ngram = SpecConfig(method="ngram", k=k, ngram_sources="group")
    hybrid = replace(fixed, method="hybrid", ngram_sources="group")
    return {
        "none": SpecConfig(method="none"),
        "adapter": replace(fixed, adaptive=False),
        "ngram_adaptive": ngram,
        "early_exit_adaptive": replace(fixed, adapter=False),
        "adapter_adaptive": fixed,
        "hybrid_adaptive": hybrid,
    }


def measure(quick: bool, repeats: int) -> tuple[dict[str, object], list[str]]:
    """Every row at every batch size, the rows decoding each timed chunk in turn."""
    model_dir = real_model_dir()
    cfg = load_config(OVERRIDES)
    tokenizer = load_tokenizer(model_dir)
    model = load_pretrained(model_dir, dtype=torch.bfloat16).eval()
    task = task_from_config(cfg.task)
    assert isinstance(task, PromptPool)
    temperature, top_p = cfg.sampling.temperature, cfg.sampling.top_p
    max_new = task.max_new_tokens
    rows = methods(cfg.spec.k, model.args.draft_exit_layer) | eagle_rows.methods(cfg.spec.k)
    warmup = json.loads((model_dir / "draft_warmup.json").read_text())
    flat: dict[str, object] = {
        "real_model": PRESET,
        "real_task": "word_problems",
        "real_temperature": temperature,
        "real_top_p": top_p,
        "real_max_new_tokens": max_new,
        "real_exit_layer": model.args.draft_exit_layer,
        "real_draft_vocab": model.args.draft_vocab_size,
        "real_k": cfg.spec.k,
        "real_warmup": warmup,
        "real_eagle_warmup": eagle_rows.warmup_summary(model_dir),
        "real_eagle_aux_layers": list(model.args.eagle_aux_layers),
        "real_eagle_draft_vocab": model.args.eagle_vocab_size or model.args.vocab_size,
    }
    table = []
    for batch in BATCHES:
        prompts_per_epoch = {1: 3, 8: 2, 32: 4}[batch] if quick else {1: 4, 8: 2, 32: 4}[batch]
        timed = chunks_of(preset_prompts(cfg, tokenizer, task, prompts_per_epoch, 0), batch)
        warm_n = 1 if batch == 1 else batch // GROUP
        warm = chunks_of(preset_prompts(cfg, tokenizer, task, warm_n, 500), batch)
        n = 1 if batch == 1 else GROUP
        engines = {}
        for name, spec in rows.items():
            engine = TorchEngine(
                model, tokenizer.eos_id, tokenizer.pad_id, temperature, top_p, seed=0, spec=spec
            )
            for chunk in warm:
                engine.generate(chunk, n, max_new)
            engine.stats()
            engines[name] = (engine, [])
        order = list(engines.values())
        for _ in range(repeats):
            for chunk in timed:
                # Every row decodes each chunk in turn (the first one moves each time), so a
                # change in the machine's load hits every row alike.
                for engine, _ in order:
                    engine.generate(chunk, n, max_new)
                order = order[1:] + order[:1]
            for engine, epochs in engines.values():
                epochs.append(engine.stats())
        table += _batch_figures(flat, engines, batch, cfg.spec.k)
        print("\n".join(table[-len(engines) :]), flush=True)
    _summarise(flat)
    flat.update(eagle_rows.wording_figures(model, tokenizer, cfg, rows))
    print(
        "held-out wording, tokens per verify at batch 8: eagle3 "
        f"{flat['real_eagle_heldout_wording_tokens_per_verify_b8']}, adapter "
        f"{flat['real_adapter_heldout_wording_tokens_per_verify_b8']}",
        flush=True,
    )
    # Parameters read per token, counted from the tensors of the model the rows decoded with.
    flat.update(eagle_rows.summary(flat, eagle_rows.param_reads(model), cfg.spec.k, BATCHES))
    return flat, table


def _median(epochs: list[dict[str, float]], key: str) -> float:
    values = sorted(e.get(key, 0.0) for e in epochs)
    return values[len(values) // 2]


def row_label(name: str, k: int) -> str:
    """A row's method as the table shows it."""
    return eagle_rows.label(name, k) if name in eagle_rows.ROWS else name


def _batch_figures(flat: dict[str, object], engines: dict, batch: int, k: int) -> list[str]:
    lines = []
    for name, key, epochs, speed, ratio in _spec_rows.speeds(flat, engines, batch, "real", _median):
        if name == "none":
            lines.append(f"| {batch} | none | {speed:,.1f} | 1.00x | – | – | – |")
            continue
        per_verify = _median(epochs, mn.SPEC_MEAN_ACCEPTED_LEN)
        accept = _median(epochs, mn.SPEC_ACCEPTANCE_RATE)
        positions = [
            round(_median(epochs, f"{mn.SPEC_ACCEPTANCE_POS_PREFIX}{i}"), 3) for i in range(1, 9)
        ]
        flat[f"{key}_tokens_per_verify"] = round(per_verify, 3)
        flat[f"{key}_acceptance"] = round(accept, 3)
        flat[f"{key}_acceptance_by_pos"] = [p for p in positions if p > 0]
        lengths = _spec_rows.draft_lengths(epochs)
        flat[f"{key}_draft_lengths"] = lengths
        lines.append(
            f"| {batch} | {row_label(name, k)} | {speed:,.1f} | {ratio:.2f}x | {accept:.2f} | "
            f"{per_verify:.2f} | {lengths or '-'} |"
        )
    return lines


def _summarise(flat: dict[str, object]) -> None:
    """The issue's keys from the per-row figures (the best method among every row measured,
    the EAGLE-3 head's included; the adaptive minimum over the adapter's family)."""
    flat["real_tokens_per_verify_b8"] = flat["real_adapter_b8_tokens_per_verify"]
    names = [*methods(1, 1), *eagle_rows.ROWS]
    for batch in BATCHES:
        ratios = {
            name: flat[f"real_{name}_b{batch}_ratio"]
            for name in names
            if name != "none" and f"real_{name}_b{batch}_ratio" in flat
        }
        best = max(ratios, key=ratios.__getitem__)
        flat[f"real_speedup_b{batch}"] = ratios[best]
        flat[f"real_best_method_b{batch}"] = best
    flat["real_adaptive_min_ratio"] = min(
        flat[f"real_{name}_b{batch}_ratio"]
        for name in methods(1, 1)
        if name.endswith("_adaptive")
        for batch in BATCHES
    )


TABLE_HEAD = [
    "| batch | method | tokens/s | vs none | acceptance | tokens per verify | draft lengths |",
    "| ---: | --- | ---: | ---: | ---: | ---: | --- |",
]


def section(quick: bool, repeats: int, rl: bool) -> tuple[dict[str, object], list[str]]:
    """The whole real-model section: every row's speed (:func:`measure`), the EAGLE-3 rows'
    chi-square (``eagle_rows.lossless``) and, with ``rl``, the RL runs (:func:`rl_figures`, then
    spec=eagle3's, ``eagle_rows.rl_figures``); an RL run that fails leaves ``real_rl_error``."""
    print("\n### real model: SmolLM2-135M-Instruct, word_problems\n")
    print("\n".join(TABLE_HEAD), flush=True)
    flat, table = measure(quick, repeats)
    flat.update(eagle_rows.lossless(quick))
    print(
        f"EAGLE-3 rows lossless: {flat['real_eagle_lossless']} (control p = "
        f"{flat['real_eagle_lossless_control_pvalue']:.3g})",
        flush=True,
    )
    if rl:
        try:
            flat.update(rl_figures())
            flat.update(eagle_rows.rl_figures(flat, E2E_STEPS))
        except subprocess.CalledProcessError as e:
            # The rows measured so far still go into the JSON; the exit status says it failed.
            flat["real_rl_error"] = str(e)
            print(f"RL figures failed: {e}", flush=True)
    return flat, table


# ------------------------------------------------------------------ RL: end to end, draft drift


def rl_figures(steps: int = E2E_STEPS, eval_prompts: int = 16) -> dict[str, object]:
    """``real_e2e_speedup``: wall time of `steps` RL steps with spec=none over the same run with
    the preset's default speculation, back to back; ``real_draft_acceptance_after_rl_over_
    before``: the online-trained draft's acceptance on the final policy's samples over the
    warm-started draft's on the initial policy's, and the same for the draft frozen at the start
    (the final policy with the initial adapter)."""
    model_dir = real_model_dir()
    cfg = load_config(OVERRIDES)
    flat: dict[str, object] = {"real_e2e_steps": steps, "real_default_spec": cfg.spec.method}
    walls = {}
    for label, extra in (("none", ["spec=none"]), ("default", [])):
        wall, summary, run_dir = rl_run(label, steps, extra)
        walls[label] = wall
        flat[f"real_e2e_{label}_wall_s"] = round(wall, 1)
        for key in RL_SUMMARY_KEYS:
            if key in summary:
                flat[f"real_e2e_{label}_{key}"] = summary[key]
    flat["real_e2e_speedup"] = round(walls["none"] / walls["default"], 3)
    d = drift(model_dir, run_dir, "draft", eval_prompts)
    # The states depend on the policy only, so the frozen draft reads the final policy's.
    before = held_out_acceptance(d.start, d.before, d.temperature, 8, 256)
    after = held_out_acceptance(d.final, d.after, d.temperature, 8, 256)
    frozen_after = held_out_acceptance(d.frozen, d.after, d.temperature, 8, 256)
    flat.update(drift_figures("real_draft_acceptance", before, after, frozen_after))
    flat["real_draft_acceptance_frozen_over_before"] = round(frozen_after / before, 3)
    return flat

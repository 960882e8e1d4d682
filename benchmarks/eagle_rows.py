"""The EAGLE-3 head's rows of the real-model section of ``benchmarks/rollout.py`` (torch engine;
benchmarks/rollout_real.py times them beside the early exit + adapter's rows):

  eagle3            the policy's EAGLE-3 head (common/eagle.py, warm-started with `specrl
                    warm-draft spec=eagle3` on first use) drafts k tokens every step
  eagle3_adaptive   the same head with ``spec.adaptive`` (each step picks k in [0, k])

Figures (``real_eagle_*``):

- ``tokens_per_verify_b8``: the ``eagle3`` row's tokens per verifier forward at batch 8.
- ``adaptive_min_ratio``: the ``eagle3_adaptive`` row's tokens/s over plain's (measured side by
  side, chunk by chunk), the least over batch 1, 8 and 32.
- ``draft_param_frac``: parameters read per draft token over parameters read per target forward,
  counted from the tensors of the loaded model (:func:`param_reads`, :data:`COUNTED`).
- ``membound_bound_b8``: tokens_per_verify_b8 / (1 + k x draft_param_frac), the memory-bound
  ceiling of the speed-up (time proportional to parameters read): a bound, not a speed.
- ``lossless``: chi-square of both rows' complete sequences against the exact plain distribution
  of an enumerable model with a fitted head (T = 1, and 0.7 with top-p 0.9), and a negative
  control (the verifier handed a wrong q) that must fail.
- ``conditional_acceptance_by_pos``: the ``eagle3`` row's acceptance at draft step j given steps
  < j were accepted, at batch 8: a_j / a_(j-1) of its acceptance by position a (a chain accepts
  step j only when every earlier step was).
- ``heldout_wording_tokens_per_verify_b8``: the ``eagle3`` row's tokens per verify at batch 8 on
  word problems of a wording family neither the warm start nor the task uses
  (``benchmarks/heldout_wording.py``); the adapter's beside it.
- ``acceptance_after_rl_over_before`` (and ``..._frozen``): the head's held-out acceptance after
  E2E_STEPS RL steps with spec=eagle3 (the learner trains it online) on the final policy's
  samples, over the warm-started head's on the initial policy's; frozen: the final policy with
  the head as it was at the start. Over RL_EVAL_PROMPTS held-out prompts x 2 samples, with a 95%
  interval (``..._ci95``): percentile bootstrap over prompts, paired (a prompt's samples before
  and after are drawn together).
- ``warmup_s``, ``warmup_tokens``: the head's `specrl warm-draft` wall time (sampling included)
  and the completion tokens it trained on, from its summary in the model directory.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch

from actors.engines.torch.engine import TorchEngine
from benchmarks import heldout_wording as wording
from common import metric_names as mn
from common.config.actor import SpecConfig
from common.model import Transformer
from testing.eagle import fit_head, one_thread, with_head
from testing.lossless_check import EOS, peaky_model, sequence_pvalue

ROWS = ("eagle3", "eagle3_adaptive")
RL_EVAL_PROMPTS = 64
"""Held-out prompts (x 2 samples) the head's drift over RL is measured on."""
BOOTSTRAP = 10_000
WORDING_PROMPTS = 6
"""Held-out-wording prompts (x 8 samples, one prompt per generate call: batch 8)."""
PVALUE_MIN = 0.01
COUNTED = (
    "parameters (elements of the loaded model's tensors) a forward reads for one token. Target "
    "forward: every decoder layer (attention, MLP, norms), the final norm, the whole LM head "
    "(tied or not, the matmul reads it all) and one embedding row. EAGLE-3 draft token: the "
    "head's decoder layer (q/k/v read 2H, o, MLP, its three norms), its final norm, its LM head "
    "(its draft-vocabulary rows only), fc [H, n_aux x H] in full (not amortised: fc runs once "
    "per step, in the first pass, so this over-counts by (k-1)/k of fc per draft token; "
    "draft_param_frac_fc_amortised counts fc / k) and one embedding row (the token it reads). "
    "Adapter draft token (for comparison): the policy's first exit_layer layers, the adapter's "
    "layer and norm, the LM head's draft-vocabulary rows, one embedding row. Not counted: d2t / "
    "vocab_ids (index maps), RoPE tables, KV caches."
)


def methods(k: int) -> dict[str, SpecConfig]:
    """The head's rows: k fixed, and adaptive (k the most)."""
    adaptive = SpecConfig(method="eagle3", k=k)
    return {"eagle3": replace(adaptive, adaptive=False), "eagle3_adaptive": adaptive}


def label(name: str, k: int) -> str:
    """A row's method as the tables show it."""
    return {"eagle3": f"eagle3 k={k}", "eagle3_adaptive": f"eagle3 adaptive (k<={k})"}[name]


# ------------------------------------------------------------------ parameters read per token


def _numel(module: torch.nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def param_reads(model: Transformer) -> dict[str, int]:
    """Parameters read per target forward and per draft token (:data:`COUNTED`), from the
    tensors of ``model`` (which has an EAGLE-3 head; an adapter is counted where it has one),
    by part; ``unaccounted``: the model's parameters in no part (0 unless a part is missed)."""
    head = model.eagle
    if head is None:
        raise ValueError("the model has no EAGLE-3 head")
    hidden = model.model.embed_tokens.weight.shape[1]
    parts = {
        "decoder_layers": _numel(model.model.layers),
        "final_norm": _numel(model.model.norm),
        "lm_head": _numel(model.lm_head),
        "embedding_row": hidden,
        "head_layer": _numel(head.midlayer),
        "head_norm": _numel(head.norm),
        "head_lm_head": _numel(head.lm_head),
        "head_fc": _numel(head.fc),
    }
    parts["target_forward"] = (
        parts["decoder_layers"] + parts["final_norm"] + parts["lm_head"] + hidden
    )
    parts["eagle_draft_token"] = (
        parts["head_layer"] + parts["head_norm"] + parts["head_lm_head"] + parts["head_fc"] + hidden
    )
    counted = {id(p) for m in (model.model, model.lm_head, head) for p in m.parameters()}
    draft = model.draft
    if draft is not None:
        exit_layer = model.args.draft_exit_layer
        rows = model.args.draft_vocab_size or model.args.vocab_size
        parts["adapter_draft_token"] = (
            _numel(model.model.layers[:exit_layer]) + _numel(draft) + rows * hidden + hidden
        )
        counted |= {id(p) for p in draft.parameters()}
    parts["unaccounted"] = sum(p.numel() for p in model.parameters() if id(p) not in counted)
    return parts


def membound_bound(tokens_per_verify: float, k: int, frac: float) -> float:
    """The memory-bound ceiling of the speed-up: a step reads 1 + k x frac target forwards'
    parameters for ``tokens_per_verify`` tokens."""
    return tokens_per_verify / (1.0 + k * frac)


def summary(flat: dict[str, object], reads: dict[str, int], k: int, batches: Iterable[int]):
    """The issue's ``real_eagle_*`` keys from the rows' figures in ``flat`` and ``reads``."""
    target = reads["target_forward"]
    frac = reads["eagle_draft_token"] / target
    amortised = (reads["eagle_draft_token"] - reads["head_fc"] * (k - 1) / k) / target
    tpv = float(flat["real_eagle3_b8_tokens_per_verify"])  # type: ignore[arg-type]
    by_pos = list(flat.get("real_eagle3_b8_acceptance_by_pos") or [])  # type: ignore[call-overload]
    ratios = {b: flat[f"real_eagle3_adaptive_b{b}_ratio"] for b in batches}
    out: dict[str, object] = {
        "real_eagle_k": k,
        "real_eagle_tokens_per_verify_b8": tpv,
        "real_eagle_conditional_acceptance_by_pos": conditional(by_pos),
        "real_eagle_adaptive_min_ratio": min(ratios.values()),  # type: ignore[type-var]
        "real_eagle_adaptive_ratio_by_batch": ratios,
        "real_eagle_params_read": reads,
        "real_eagle_params_counted": COUNTED,
        "real_eagle_draft_param_frac": round(frac, 5),
        "real_eagle_draft_param_frac_fc_amortised": round(amortised, 5),
        "real_eagle_membound_bound_b8": round(membound_bound(tpv, k, frac), 4),
        "real_eagle_membound_bound_b8_fc_amortised": round(membound_bound(tpv, k, amortised), 4),
        "real_eagle_membound_bound_is": (
            "a bound, not a speed: tokens_per_verify_b8 / (1 + k x draft_param_frac), the "
            "speed-up if a step's time were proportional to the parameters it reads"
        ),
    }
    warm = flat.get("real_eagle_warmup")
    if isinstance(warm, dict):
        out["real_eagle_warmup_s"] = warm["seconds"]
        out["real_eagle_warmup_tokens"] = warm["train_tokens"]
        out["real_eagle_warmup_threads"] = warm.get("threads")
    if "adapter_draft_token" in reads and "real_adapter_b8_tokens_per_verify" in flat:
        adapter_frac = reads["adapter_draft_token"] / target
        adapter_tpv = float(flat["real_adapter_b8_tokens_per_verify"])  # type: ignore[arg-type]
        out["real_adapter_draft_param_frac"] = round(adapter_frac, 5)
        out["real_adapter_membound_bound_b8"] = round(
            membound_bound(adapter_tpv, k, adapter_frac), 4
        )
    return out


def conditional(by_pos: list[float]) -> list[float]:
    """Acceptance at step j given steps < j were accepted, from the acceptance by position."""
    out, reach = [], 1.0
    for a in by_pos:
        out.append(round(a / reach, 3) if reach > 0 else 0.0)
        reach = a
    return out


# ------------------------------------------------------------------ held-out wording


def wording_figures(model: Transformer, tokenizer, cfg, rows: dict[str, SpecConfig]) -> dict:
    """Tokens per verify and acceptance by position of the ``eagle3`` and ``adapter`` rows at
    batch 8 (1 prompt x 8 samples per call) on WORDING_PROMPTS problems of the held-out wording
    family (``benchmarks/heldout_wording.py``), encoded as the task's prompts are."""
    from common.prompts import prompt_encoder

    encode = prompt_encoder(
        tokenizer, cfg.task.chat_template, cfg.task.system_prompt, cfg.task.natural_language
    )
    problems = wording.problems(WORDING_PROMPTS)
    prompts = [encode(text) for text, _ in problems]
    out: dict[str, object] = {
        "real_heldout_wording_prompts": len(prompts),
        "real_heldout_wording_example": problems[0][0],
    }
    for name in ("eagle3", "adapter"):
        engine = TorchEngine(
            model,
            tokenizer.eos_id,
            tokenizer.pad_id,
            cfg.sampling.temperature,
            cfg.sampling.top_p,
            seed=0,
            spec=rows[name],
        )
        for prompt in prompts:
            engine.generate([prompt], 8, cfg.task.max_new_tokens)
        stats = engine.stats()
        prefix = "real_eagle" if name == "eagle3" else "real_adapter"
        out[f"{prefix}_heldout_wording_tokens_per_verify_b8"] = round(
            stats[mn.SPEC_MEAN_ACCEPTED_LEN], 3
        )
        positions = [stats.get(f"{mn.SPEC_ACCEPTANCE_POS_PREFIX}{i}", 0.0) for i in range(1, 9)]
        out[f"{prefix}_heldout_wording_acceptance_by_pos"] = [
            round(p, 3) for p in positions if p > 0
        ]
    return out


# ------------------------------------------------------------------ lossless


LOSSLESS_VOCAB = (0, 2, 3, 4, 5)
"""The enumerable model's head's vocabulary: EOS (2) included, token 1 left out."""
LOSSLESS_PROMPT = [1, 4, 5, 4]
SETTINGS = ((1.0, 1.0), (0.7, 0.9))


def lossless_model() -> Transformer:
    """Vocabulary 6, a head over LOSSLESS_VOCAB fitted a little (drafts accepted and rejected)."""
    model = with_head(peaky_model(vocab=6, seed=1, scale=8.0), LOSSLESS_VOCAB, seed=2)
    fit_head(model, steps=60, seed=3)
    return model


def jittery_clock(seed: int) -> Callable[[], float]:
    """Step times the adaptive controller cannot settle on: it keeps changing k (every draft
    length is exercised)."""
    rng, now = random.Random(seed), [0.0]

    def clock() -> float:
        now[0] += rng.uniform(0.1, 2.0)
        return now[0]

    return clock


def _wrong_q(engine: TorchEngine) -> None:
    """The negative control: the verifier is handed a uniform q over the head's vocabulary while
    the drafts are still sampled from the head's q."""
    drafter = engine.eagle
    assert drafter is not None
    real = drafter._sample
    uniform = -torch.log(torch.tensor(float(len(LOSSLESS_VOCAB))))

    def wrong(*args, **kwargs):
        tokens, q = real(*args, **kwargs)
        return tokens, torch.where(torch.isfinite(q), uniform, q)

    drafter._sample = wrong  # type: ignore[method-assign]


def lossless(quick: bool, k: int = 3) -> dict[str, object]:
    """``real_eagle_lossless``: both rows at T = 1 and T = 0.7 / top-p 0.9 pass the chi-square
    (p >= PVALUE_MIN) and the wrong-q control fails it (module docstring)."""
    samples = 2000 if quick else 6000
    out: dict[str, object] = {}
    with one_thread():
        model = lossless_model()
        for name, spec in methods(k).items():
            for temperature, top_p in SETTINGS:
                engine = TorchEngine(model, EOS, 0, temperature, top_p, seed=7, spec=spec)
                if engine.draft_length is not None:
                    engine.draft_length.clock = jittery_clock(2)
                p = sequence_pvalue(engine, LOSSLESS_PROMPT, 3, samples)
                key = f"real_eagle_lossless_pvalue_{name}_t{temperature}_p{top_p}"
                out[key] = round(p, 4)
                out[key.replace("_pvalue_", "_acceptance_")] = round(
                    engine.stats()[mn.SPEC_ACCEPTANCE_RATE], 3
                )
        engine = TorchEngine(model, EOS, 0, 1.0, seed=7, spec=methods(k)["eagle3"])
        _wrong_q(engine)
        try:
            control = sequence_pvalue(engine, LOSSLESS_PROMPT, 3, samples)
        except KeyError:  # an output the plain distribution cannot produce
            control = 0.0
    control_is = "wrong q: uniform over the head's vocabulary"
    return out | verdict("real_eagle_lossless", out, control, control_is, samples, k)


def verdict(
    prefix: str, pvalues: dict[str, object], control: float, control_is: str, samples: int, k: int
) -> dict[str, object]:
    """A lossless check's keys: ``prefix`` (whether every ``*_pvalue_*`` figure of ``pvalues``
    reaches PVALUE_MIN while the control's p-value does not), the control's p-value and what it
    is, the samples per setting and k."""
    values = [v for key, v in pvalues.items() if "_pvalue_" in key]
    return {
        prefix: min(values) >= PVALUE_MIN and control < PVALUE_MIN,  # type: ignore[operator]
        f"{prefix}_control_pvalue": control,
        f"{prefix}_control": control_is,
        f"{prefix}_samples": samples,
        f"{prefix}_k": k,
    }


# ------------------------------------------------------------------ RL: the head's drift


def rl_figures(
    flat: dict[str, object], steps: int, eval_prompts: int = RL_EVAL_PROMPTS
) -> dict[str, object]:
    """One `specrl run` of E2E ``steps`` steps with spec=eagle3 (the head trained online): its
    wall time (and over spec=none's, when ``flat`` has it) and the head's acceptance drift."""
    from benchmarks.real_preset import (
        OVERRIDES,
        RL_SUMMARY_KEYS,
        drift,
        drift_figures,
        real_model_dir,
        rl_run,
    )

    model_dir = real_model_dir()
    wall, run_summary, run_dir = rl_run("eagle3", steps, ["spec=eagle3"])
    out: dict[str, object] = {"real_e2e_eagle3_wall_s": round(wall, 1)}
    for key in RL_SUMMARY_KEYS:
        if key in run_summary:
            out[f"real_e2e_eagle3_{key}"] = run_summary[key]
    if flat.get("real_e2e_none_wall_s"):
        out["real_e2e_eagle3_speedup"] = round(float(flat["real_e2e_none_wall_s"]) / wall, 3)  # type: ignore[arg-type]
    d = drift(model_dir, run_dir, "eagle", eval_prompts)
    before = prompt_acceptance(d.start, d.before, d.temperature)
    # The head's inputs are the policy's states, so the frozen head reads the final policy's.
    after = prompt_acceptance(d.final, d.after, d.temperature)
    frozen_after = prompt_acceptance(d.frozen, d.after, d.temperature)
    means = [pooled(x) for x in (before, after, frozen_after)]
    out.update(drift_figures("real_eagle_acceptance", *means))
    out.update(
        real_eagle_acceptance_after_rl_over_before_ci95=ratio_ci95(after, before),
        real_eagle_acceptance_after_rl_over_before_frozen=round(means[2] / means[0], 3),
        real_eagle_acceptance_after_rl_over_before_frozen_ci95=ratio_ci95(frozen_after, before),
        real_eagle_acceptance_eval_prompts=eval_prompts,
        real_eagle_acceptance_ci_method=(
            f"percentile bootstrap ({BOOTSTRAP} resamples of the prompts, paired: a prompt's "
            "samples before and after drawn together), 2.5% and 97.5%"
        ),
        real_eagle_rl_steps=steps,
        real_eagle_rl_command=f"specrl run {' '.join(OVERRIDES)} spec=eagle3 run.steps={steps}",
    )
    return out


def prompt_acceptance(
    policy: Transformer, samples, temperature: float, per_prompt: int = 2
) -> list[tuple[float, int]]:
    """Per prompt (``per_prompt`` consecutive samples each, as ``real_preset.held_out_samples``
    makes them), the summed per-token acceptance sum_v min(p, q) of ``policy``'s head at draft
    step 1 and the tokens summed over (``learner.prepare.eagle_warmup.held_out_acceptance``, as
    `specrl warm-draft` measures it)."""
    from learner.prepare.eagle_warmup import held_out_acceptance, teacher_states

    records = teacher_states(policy, samples, 8)
    out = []
    for i in range(0, len(records), per_prompt):
        part = records[i : i + per_prompt]
        tokens = sum(len(r.completion) for r in part)
        out.append((held_out_acceptance(policy, part, temperature, 8, 256) * tokens, tokens))
    return out


def pooled(per_prompt: list[tuple[float, int]]) -> float:
    """The per-token mean over every prompt's tokens."""
    return sum(a for a, _ in per_prompt) / max(sum(n for _, n in per_prompt), 1)


def ratio_ci95(
    after: list[tuple[float, int]], before: list[tuple[float, int]], seed: int = 0
) -> list[float]:
    """The 95% percentile-bootstrap interval of pooled(after) / pooled(before), prompts
    resampled with replacement, each prompt's pair kept together."""
    if len(after) != len(before) or not after:
        raise ValueError("after and before need the same prompts, at least one")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(after), (BOOTSTRAP, len(after)), generator=gen)
    a, an, b, bn = (
        torch.tensor([x[j] for x in seq], dtype=torch.float64)
        for seq, j in ((after, 0), (after, 1), (before, 0), (before, 1))
    )
    ratios = (a[idx].sum(1) / an[idx].sum(1)) / (b[idx].sum(1) / bn[idx].sum(1))
    low, high = torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=torch.float64))
    return [round(float(low), 3), round(float(high), 3)]


def warmup_summary(model_dir) -> dict[str, object] | None:
    """The head's `specrl warm-draft` summary in the model directory, if any."""
    from learner.prepare.eagle_warmup import EAGLE_SUMMARY_FILE

    path = model_dir / EAGLE_SUMMARY_FILE
    return json.loads(path.read_text()) if path.is_file() else None

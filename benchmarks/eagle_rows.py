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
- ``acceptance_after_rl_over_before`` (and ``..._frozen``): the head's held-out acceptance after
  E2E_STEPS RL steps with spec=eagle3 (the learner trains it online) on the final policy's
  samples, over the warm-started head's on the initial policy's; frozen: the final policy with
  the head as it was at the start.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch

from actors.engines.torch_engine import TorchEngine
from common import metric_names as mn
from common.config.actor import SpecConfig
from common.model import Transformer
from testing.eagle import fit_head, one_thread, with_head
from testing.lossless_check import EOS, peaky_model, sequence_pvalue

ROWS = ("eagle3", "eagle3_adaptive")
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
    ratios = {b: flat[f"real_eagle3_adaptive_b{b}_ratio"] for b in batches}
    out: dict[str, object] = {
        "real_eagle_k": k,
        "real_eagle_tokens_per_verify_b8": tpv,
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
    if "adapter_draft_token" in reads and "real_adapter_b8_tokens_per_verify" in flat:
        adapter_frac = reads["adapter_draft_token"] / target
        adapter_tpv = float(flat["real_adapter_b8_tokens_per_verify"])  # type: ignore[arg-type]
        out["real_adapter_draft_param_frac"] = round(adapter_frac, 5)
        out["real_adapter_membound_bound_b8"] = round(
            membound_bound(adapter_tpv, k, adapter_frac), 4
        )
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


def rl_figures(flat: dict[str, object], steps: int, eval_prompts: int = 16) -> dict[str, object]:
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
    before = head_acceptance(d.start, d.before, d.temperature)
    # The head's inputs are the policy's states, so the frozen head reads the final policy's.
    after, frozen_after = head_acceptance(d.final, d.after, d.temperature, also=d.frozen)
    out.update(drift_figures("real_eagle_acceptance", before, after, frozen_after))
    out.update(
        real_eagle_acceptance_after_rl_over_before_frozen=round(frozen_after / before, 3),
        real_eagle_rl_steps=steps,
        real_eagle_rl_command=f"specrl run {' '.join(OVERRIDES)} spec=eagle3 run.steps={steps}",
    )
    return out


def head_acceptance(policy: Transformer, samples, temperature: float, also=None):
    """Mean per-token acceptance sum_v min(p, q) of ``policy``'s head over ``samples``
    (``learner.prepare.eagle_warmup.held_out_acceptance``, as `specrl warm-draft` measures it); with
    ``also`` (the same policy, another head), the pair."""
    from learner.prepare.eagle_warmup import held_out_acceptance, teacher_states

    records = teacher_states(policy, samples, 8)
    mine = held_out_acceptance(policy, records, temperature, 8, 256)
    if also is None:
        return mine
    return mine, held_out_acceptance(also, records, temperature, 8, 256)


def warmup_summary(model_dir) -> dict[str, object] | None:
    """The head's `specrl warm-draft` summary in the model directory, if any."""
    from learner.prepare.eagle_warmup import EAGLE_SUMMARY_FILE

    path = model_dir / EAGLE_SUMMARY_FILE
    return json.loads(path.read_text()) if path.is_file() else None

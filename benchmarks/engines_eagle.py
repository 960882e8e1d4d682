"""The EAGLE-3 head's rows of ``benchmarks/engines.py --only real``: the policy's head served by
vLLM's native ``eagle3`` proposer (``spec.method=eagle3``, actors/engines/vllm/eagle.py) on the
real model (SmolLM2-135M-Instruct with its warm-started head, benchmarks/rollout_real.py), at the
preset's sampling settings.

  vllm plain        vLLM, no speculation, built and timed beside the head's row (the baseline of
                    its ratio: vLLM's spec-decode counters live in a process-wide registry, so
                    the head's engine is the only speculative one alive, and the newest)
  vllm eagle3 k=4   the head drafts k tokens every step (vLLM's native proposer has no adaptive k)

Figures (``real_vllm_eagle_*``): tokens/s and its ratio to that plain row, tokens per verify
(1 + accepted / draft steps, vLLM's counters), acceptance by draft position, and the step cost:
the median wall time of one engine step (``LLMEngine.step``, timed around each call) of the
head's engine over the plain engine's, i.e. a k-token draft + verify step in plain steps (the
same chunks, interleaved); ``..._step_cost_from_throughput`` derives the same from the two
speeds (tokens_per_verify x plain tokens/s / eagle tokens/s). ``real_vllm_eagle_lossless``:
chi-square of complete sequences sampled through the head on an enumerable model (T = 1 and
T = 0.7 / top-p 0.9; the set-up of tests/engine_vllm/test_vllm_eagle.py, testing/vllm_eagle.py),
and a negative control (the rejection sampler handed the head's q with its token ids rotated)
that must fail.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.eagle_rows import verdict
from benchmarks.vllm_kit import interleaved, make_vllm, warmed_chunks
from common import metric_names as mn
from common.config import load_config
from common.config.actor import SpecConfig
from common.tasks import task_from_config
from common.tokenizer import load_tokenizer


class StepClock:
    """Times every ``step()`` of a vLLM engine's ``LLMEngine`` (what VllmEngine calls in its
    decoding loop): the wall seconds of each, since :meth:`reset`."""

    def __init__(self, engine) -> None:
        self.seconds: list[float] = []
        llm_engine = engine.llm.llm_engine
        inner = llm_engine.step

        def step(*args, **kwargs):
            started = time.perf_counter()
            out = inner(*args, **kwargs)
            self.seconds.append(time.perf_counter() - started)
            return out

        llm_engine.step = step

    def reset(self) -> None:
        self.seconds = []


def real_speed(quick: bool, batches, repeats: int, k: int) -> dict[str, object]:
    """vllm plain and vllm eagle3 (k fixed) on the real model, chunk by chunk in turn (the
    first engine moves each time); the figures of the module docstring."""
    from benchmarks.real_preset import OVERRIDES, real_model_dir

    model_dir = real_model_dir()
    cfg = load_config(OVERRIDES)
    tokenizer = load_tokenizer(model_dir)
    task = task_from_config(cfg.task)
    t, top_p = cfg.sampling.temperature, cfg.sampling.top_p
    spec = SpecConfig(method="eagle3", k=k, adaptive=False)
    # The head's engine last: vLLM's counters report the newest engine.
    engines = {
        name: make_vllm(model_dir, tokenizer.eos_id, 2048, spec=s, temperature=t, top_p=top_p)
        for name, s in (("vllm_plain", None), ("vllm_eagle", spec))
    }
    clocks = {name: StepClock(engine) for name, engine in engines.items()}
    figures: dict[str, object] = {"real_vllm_eagle_k": k, "real_vllm_eagle_temperature": t}
    for batch in batches:
        timed = warmed_chunks(engines, cfg, tokenizer, task, batch, quick)
        for clock in clocks.values():
            clock.reset()
        tokens, seconds = interleaved(engines, timed, repeats, task.max_new_tokens)
        speeds = {name: tokens[name] / seconds[name] for name in engines}
        steps = {name: clocks[name].seconds for name in engines}
        figures.update(batch_figures(batch, speeds, steps, engines["vllm_eagle"].stats(), k))
    engines.clear()
    gc.collect()
    return figures


def batch_figures(batch: int, speeds: dict, steps: dict, stats: dict, k: int) -> dict[str, object]:
    """One batch size's keys from the two rows' tokens/s, engine step times and the head's
    engine's stats; prints its table rows."""
    key = f"real_vllm_eagle_b{batch}"
    plain_step = statistics.median(steps["vllm_plain"])
    eagle_step = statistics.median(steps["vllm_eagle"])
    tpv = stats[mn.SPEC_MEAN_ACCEPTED_LEN]
    ratio = speeds["vllm_eagle"] / speeds["vllm_plain"]
    positions = [stats.get(f"{mn.SPEC_ACCEPTANCE_POS_PREFIX}{i}", 0.0) for i in range(1, k + 1)]
    figures: dict[str, object] = {
        f"real_vllm_eagle_plain_b{batch}_tokens_per_s": round(speeds["vllm_plain"], 1),
        f"{key}_tokens_per_s": round(speeds["vllm_eagle"], 1),
        f"real_vllm_eagle_over_vllm_plain_b{batch}": round(ratio, 3),
        f"{key}_tokens_per_verify": round(tpv, 3),
        f"{key}_acceptance": round(stats[mn.SPEC_ACCEPTANCE_RATE], 3),
        f"{key}_acceptance_by_pos": [round(p, 3) for p in positions],
        f"{key}_draft_version": stats.get(mn.SPEC_DRAFT_VERSION),
        f"{key}_step_cost": round(eagle_step / plain_step, 3),
        f"{key}_step_cost_from_throughput": round(tpv / ratio, 3),
        f"{key}_step_s_median": round(eagle_step, 5),
        f"real_vllm_eagle_plain_b{batch}_step_s_median": round(plain_step, 5),
        f"{key}_steps": len(steps["vllm_eagle"]),
        f"real_vllm_eagle_plain_b{batch}_steps": len(steps["vllm_plain"]),
    }
    print(
        f"| real | {batch} | vllm plain (beside eagle3) | {speeds['vllm_plain']:,.1f} | 1.00x | - |"
        f"\n| real | {batch} | vllm eagle3 k={k} | {speeds['vllm_eagle']:,.1f} | {ratio:.2f}x | "
        f"{tpv:.2f} |",
        flush=True,
    )
    return figures


def summary(figures: dict[str, object]) -> dict[str, object]:
    """The headline keys (batch 8)."""
    out: dict[str, object] = {}
    if "real_vllm_eagle_b8_tokens_per_verify" in figures:
        out["real_vllm_eagle_tokens_per_verify_b8"] = figures[
            "real_vllm_eagle_b8_tokens_per_verify"
        ]
    return out


# ------------------------------------------------------------------ lossless


def lossless(quick: bool) -> dict[str, object]:
    """``real_vllm_eagle_lossless`` (module docstring), on an engine started from a published
    version's directory, as an actor starts it."""
    from testing import vllm_eagle as setup

    model = setup.enumerable_policy(1)
    path = Path(tempfile.mkdtemp(prefix="specrl-eagle-lossless-")) / "policy"
    engine = setup.published_engine(
        model, path, SpecConfig(method="eagle3", k=setup.K, adaptive=False)
    )
    clock = StepClock(engine)
    samples = 900 if quick else 3000
    figures: dict[str, object] = {}
    for t, top_p in ((1.0, 1.0), (0.7, 0.9)):
        engine.stats()
        out = setup.sample(engine, samples, t, top_p)
        figures[f"real_vllm_eagle_lossless_pvalue_t{t}_p{top_p}"] = round(
            setup.pvalue(model, out, t, top_p), 4
        )
        figures[f"real_vllm_eagle_lossless_acceptance_t{t}_p{top_p}"] = round(
            engine.stats()[mn.SPEC_ACCEPTANCE_RATE], 3
        )
    with setup.rotated_draft_q(engine):  # the negative control
        control = setup.pvalue(model, setup.sample(engine, 600 if quick else 1500))
    steps = len(clock.seconds)
    del engine
    gc.collect()
    control_is = "wrong q: the head's q with its token ids rotated by one"
    figures |= verdict("real_vllm_eagle_lossless", figures, control, control_is, samples, setup.K)
    return figures | {"real_vllm_eagle_lossless_engine_steps": steps}

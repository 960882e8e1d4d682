"""The EAGLE-3 head's rows of ``benchmarks/engines.py --only real``: the policy's head served by
vLLM's native ``eagle3`` proposer (``spec.method=eagle3``, actors/engines/vllm_eagle.py) on the
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
T = 0.7 / top-p 0.9; tests/engine_vllm/test_vllm_eagle.py's set-up), and a negative control (the
rejection sampler handed the head's q with its token ids rotated) that must fail.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

from common import metric_names as mn
from common.config import load_config
from common.config.actor import EngineConfig, SpecConfig
from common.tasks import task_from_config
from common.tokenizer import load_tokenizer

GROUP = 8
PVALUE_MIN = 0.01


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


def _engine(model_dir: Path, eos: int, spec: SpecConfig | None, temperature: float, top_p: float):
    from actors.engines.vllm_engine import VllmEngine

    return VllmEngine(
        model_dir,
        eos,
        EngineConfig(vllm_max_model_len=2048),
        spec=spec,
        inflight="keep",
        temperature=temperature,
        top_p=top_p,
        seed=0,
    )


def real_speed(quick: bool, batches, repeats: int, k: int) -> dict[str, object]:
    """vllm plain and vllm eagle3 (k fixed) on the real model, chunk by chunk in turn (the
    first engine moves each time); the figures of the module docstring."""
    from benchmarks.real_preset import OVERRIDES, chunks_of, preset_prompts, real_model_dir

    model_dir = real_model_dir()
    cfg = load_config(OVERRIDES)
    tokenizer = load_tokenizer(model_dir)
    task = task_from_config(cfg.task)
    t, top_p, max_new = cfg.sampling.temperature, cfg.sampling.top_p, task.max_new_tokens
    spec = SpecConfig(method="eagle3", k=k, adaptive=False)
    # The head's engine last: vLLM's counters report the newest engine.
    engines = {
        "vllm_plain": _engine(model_dir, tokenizer.eos_id, None, t, top_p),
        "vllm_eagle": _engine(model_dir, tokenizer.eos_id, spec, t, top_p),
    }
    clocks = {name: StepClock(engine) for name, engine in engines.items()}
    figures: dict[str, object] = {"real_vllm_eagle_k": k, "real_vllm_eagle_temperature": t}
    for batch in batches:
        per_epoch = batch // GROUP * (1 if quick else 2)
        timed = chunks_of(preset_prompts(cfg, tokenizer, task, per_epoch, 0), batch)
        warm = chunks_of(preset_prompts(cfg, tokenizer, task, batch // GROUP, 500), batch)
        for name, engine in engines.items():
            for chunk in warm:
                engine.generate(chunk, GROUP, max_new)
            engine.stats()
            clocks[name].reset()
        order = list(engines)
        tokens, seconds = dict.fromkeys(engines, 0), dict.fromkeys(engines, 0.0)
        for _ in range(repeats):
            for chunk in timed:
                for name in order:
                    started = time.perf_counter()
                    out = engines[name].generate(chunk, GROUP, max_new)
                    seconds[name] += time.perf_counter() - started
                    tokens[name] += sum(len(r.token_ids) for g in out for r in g)
                order = order[1:] + order[:1]
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

PROMPT, NO_EOS, NEW = [1, 4, 5, 4], 99, 3
AUX, VOCAB_IDS, K = (1, 2, 3), (0, 2, 3, 4, 5), 2


def _policy(seed: int):
    """An enumerable peaky model with a random EAGLE-3 head over 5 of its 6 tokens (``d2t``)
    reading the residual stream after layers 1, 2 and 3."""
    from testing.lossless_check import peaky_model
    from testing.vllm_eagle import with_head

    return with_head(peaky_model(6, seed, 6.0), AUX, VOCAB_IDS, seed=seed + 10)


def _sample(engine, n: int, temperature: float, top_p: float) -> list:
    engine.temperature, engine.top_p = temperature, top_p  # read per request
    out = []
    for _ in range(max(1, n // 300)):
        out += engine.generate([PROMPT], 300, NEW)[0]
    return out


def _pvalue(model, out, temperature: float, top_p: float) -> float:
    """Chi-square p of ``out`` against ``model``'s exact law; 0 when a sample lies outside it."""
    from testing.lossless_check import exact_sequence_logprobs, rollouts_pvalue

    law = exact_sequence_logprobs(model, PROMPT, NEW, temperature, top_p, NO_EOS)
    try:
        return rollouts_pvalue(law, out)
    except KeyError:
        return 0.0


def _rotated_q_pvalue(engine, model, samples: int) -> float:
    """The negative control: vLLM's rejection sampler reads the head's q with its token ids
    rotated by one while the drafts are still drawn from the true q; the p-value of ``samples``
    sequences at T = 1 against ``model``'s law (the drafter restored after)."""
    drafter = engine.llm.collective_rpc(lambda worker: worker.model_runner.drafter)[0]
    take = drafter.take_last_draft_probs

    def rotated():
        q = take()
        return None if q is None else q.roll(1, dims=-1).contiguous()

    drafter.take_last_draft_probs = rotated
    try:
        return _pvalue(model, _sample(engine, samples, 1.0, 1.0), 1.0, 1.0)
    finally:
        del drafter.take_last_draft_probs  # the class's method again


def lossless(quick: bool) -> dict[str, object]:
    """``real_vllm_eagle_lossless`` (module docstring), on an engine started from a published
    version's directory, as an actor starts it."""
    from actors.engines.vllm_engine import VllmEngine
    from actors.wiring import write_published
    from common.policy_meta import policy_meta
    from common.tokenizer import CharTokenizer
    from testing.vllm_eagle import published

    model = _policy(1)
    path = Path(tempfile.mkdtemp(prefix="specrl-eagle-lossless-")) / "policy"
    write_published(policy_meta(model.args, CharTokenizer("abc")), published(model), path)
    spec = SpecConfig(method="eagle3", k=K, adaptive=False)
    engine = VllmEngine(
        path,
        NO_EOS,
        EngineConfig(vllm_max_model_len=32),
        spec=spec,
        inflight="keep",
        seed=5,
        version=0,
    )
    clock = StepClock(engine)
    samples = 900 if quick else 3000
    figures: dict[str, object] = {}
    for t, top_p in ((1.0, 1.0), (0.7, 0.9)):
        engine.stats()
        out = _sample(engine, samples, t, top_p)
        figures[f"real_vllm_eagle_lossless_pvalue_t{t}_p{top_p}"] = round(
            _pvalue(model, out, t, top_p), 4
        )
        figures[f"real_vllm_eagle_lossless_acceptance_t{t}_p{top_p}"] = round(
            engine.stats()[mn.SPEC_ACCEPTANCE_RATE], 3
        )
    control = _rotated_q_pvalue(engine, model, 600 if quick else 1500)
    steps = len(clock.seconds)
    del engine
    gc.collect()
    pvalues = [v for key, v in figures.items() if "_pvalue_" in key]
    figures.update(
        real_vllm_eagle_lossless=min(pvalues) >= PVALUE_MIN and control < PVALUE_MIN,  # type: ignore[operator]
        real_vllm_eagle_lossless_control_pvalue=control,
        real_vllm_eagle_lossless_control="wrong q: the head's q with its token ids rotated by one",
        real_vllm_eagle_lossless_samples=samples,
        real_vllm_eagle_lossless_k=K,
        real_vllm_eagle_lossless_engine_steps=steps,
    )
    return figures

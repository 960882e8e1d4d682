"""What each in-flight mode does when new weights land mid-rollout, side by side in one process.

    python -m benchmarks.inflight [--quick] [--json PATH]

Versions: the RL-trained demo model (see benchmarks/rollout.py, cached under runs/bench/) is
trained on for a few more *real* learner steps here (rollouts -> GRPO/PPO step -> next version),
giving consecutive versions v0..vN as an asynchronous run publishes them. Each generate call
starts under v_i and receives v_{i+1} after its first decoding step, while rollouts are in
flight, exactly as an actor polling Redis would. Per mode: share of in-flight tokens kept,
delivered tokens/s, wasted tokens, and, on the resulting trajectories, what the learner sees:
mean |log pi_learner - log pi_behaviour| and the PPO clipped fraction against v_{i+1}.

`exact_pvalue` / `keep_pvalue`: chi-square of complete sequences after a mid-generation swap
against the new policy's exact distribution (two fixed weight versions of a tiny-vocabulary
model, every output enumerable), for verify_on_swap and keep, measured in this run.
"""

from __future__ import annotations

import copy
import random
import sys
import time
from pathlib import Path

import torch

from actors.engines.torch.engine import TorchEngine
from actors.loop import make_groups
from benchmarks import cli
from benchmarks.rollout import Workload, rl_model
from common import metric_names as mn
from common.config import load_config
from common.config.learner import LearnerConfig
from common.config.modes import INFLIGHT_MODES
from common.config.run import SamplingConfig
from common.model import Transformer, load_pretrained
from common.tasks import task_from_config
from common.tokenizer import encode_prompt, load_tokenizer
from learner.batch import collate
from learner.loss import ppo_clip_loss
from learner.optim import make_optimizer
from learner.step import Trainer
from testing.lossless_check import (
    exact_sequence_logprobs,
    peaky_model,
    rollouts_pvalue,
)
from testing.models import token_logprobs

ROOT = Path(__file__).resolve().parent.parent

GROUP = 8
PROMPTS_PER_BATCH = 2


def consecutive_versions(model, task, tokenizer, n_versions, rng) -> list[dict[str, torch.Tensor]]:
    """v0..vN from real learner steps on the model's own rollouts (one step per version)."""
    learner = copy.deepcopy(model)
    cfg = LearnerConfig()
    optimizer = make_optimizer(learner, cfg)
    engine = TorchEngine(
        copy.deepcopy(model), tokenizer.eos_id, tokenizer.pad_id, seed=1, version=0
    )
    versions = [{k: v.clone() for k, v in learner.state_dict().items()}]
    for v in range(n_versions):
        problems = task.sample(rng, 16)
        prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
        rollouts = engine.generate(prompts, GROUP, task.max_new_tokens)
        batch = collate(
            make_groups(problems, prompts, rollouts, task, tokenizer),
            v,
            tokenizer.pad_id,
            torch.device("cpu"),
        )
        Trainer(learner, optimizer, cfg, SamplingConfig()).step(batch)
        versions.append({k: t.detach().clone() for k, t in learner.state_dict().items()})
        engine.load_weights(v + 1, versions[-1])
    return versions


def run_mode(mode, versions, task, tokenizer, problems, args) -> dict[str, float]:
    model = Transformer(args)
    model.load_state_dict(versions[0])
    engine = TorchEngine(
        model.eval(), tokenizer.eos_id, tokenizer.pad_id, seed=0, version=0, inflight=mode
    )
    learner_view = Transformer(args).eval()
    abs_lr, clip, tokens_seen = 0.0, 0.0, 0
    started = time.perf_counter()
    delivered = 0
    for i in range(0, len(problems), PROMPTS_PER_BATCH):
        v = (i // PROMPTS_PER_BATCH) % (len(versions) - 1)
        if engine.version != v:
            engine.load_weights(v, versions[v])
        calls = {"n": 0}

        def source(v=v, calls=calls):
            calls["n"] += 1  # 1: after the prefill, 2: after the first decoding step
            return (v + 1, versions[v + 1]) if calls["n"] == 2 else None

        chunk = problems[i : i + PROMPTS_PER_BATCH]
        prompts = [encode_prompt(tokenizer, p.prompt) for p in chunk]
        rollouts = engine.generate(prompts, GROUP, task.max_new_tokens, weight_source=source)
        delivered += sum(len(r.token_ids) for g in rollouts for r in g)
        # What the learner (now at v+1) sees on these trajectories.
        learner_view.load_state_dict(versions[v + 1])
        batch = collate(
            make_groups(chunk, prompts, rollouts, task, tokenizer),
            v + 1,
            tokenizer.pad_id,
            torch.device("cpu"),
        )
        with torch.no_grad():
            lp = token_logprobs(
                learner_view(batch.input_ids)[:, :-1], batch.targets, 1.0
            ).masked_fill(batch.mask == 0, 0.0)
            out = ppo_clip_loss(
                lp, batch.behaviour_logprobs, batch.advantages, batch.mask, 0.2, 3.0
            )
        n = batch.num_tokens
        abs_lr += float(out.abs_log_ratio) * n
        clip += float(out.clip_frac) * n
        tokens_seen += n
    elapsed = time.perf_counter() - started
    stats = engine.stats()
    inflight = stats.get(mn.VERIFY_INFLIGHT_TOKENS, 0.0)
    salvaged = stats.get(mn.VERIFY_SALVAGED_TOKENS, 0.0)
    kept = {"keep": inflight, "abort": 0.0}.get(mode, salvaged)
    return {
        "inflight_tokens": inflight,
        "kept_frac": kept / inflight if inflight else float("nan"),
        "wasted_tokens": stats.get(mn.VERIFY_WASTED_TOKENS, 0.0),
        "verify_forward_tokens": stats.get(mn.VERIFY_FORWARD_TOKENS, 0.0),
        "tokens_per_s": delivered / elapsed,
        "abs_log_ratio": abs_lr / tokens_seen,
        "clip_frac": clip / tokens_seen,
        "acceptance_gap1": stats.get(mn.VERIFY_ACCEPTANCE_GAP1, float("nan")),
    }


def exactness_pvalues(samples: int) -> dict[str, float]:
    """verify_on_swap and keep against the new policy's exact distribution (tiny vocabulary)."""

    old, new = peaky_model(6, 1, 6.0), peaky_model(6, 2, 6.0)
    prompt, no_eos = [1, 4, 5, 4], 99
    exact = exact_sequence_logprobs(new, prompt, 3, 1.0, 1.0, no_eos)
    out = {}
    for mode in ("verify_on_swap", "verify_on_finish", "keep"):
        engine = TorchEngine(copy.deepcopy(old), no_eos, 0, seed=11, version=0, inflight=mode)
        calls = {"n": 0}

        def source(calls=calls):
            calls["n"] += 1
            return (1, new.state_dict()) if calls["n"] == 2 else None

        rollouts = engine.generate([prompt], samples, 3, weight_source=source)[0]
        out[mode] = rollouts_pvalue(exact, rollouts)
    return out


def main() -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--quick", action="store_true")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    pvalues = exactness_pvalues(4000 if opts.quick else 8000)
    print(f"exactness after a mid-generation swap (chi-square vs the new policy): {pvalues}")

    ckpt = rl_model(Workload("demo", ["spec=early_exit"], 150 if opts.quick else 400, 32))
    model = load_pretrained(ckpt).eval()
    tokenizer = load_tokenizer(ckpt)
    task = task_from_config(load_config([]).task)
    rng = random.Random(0)
    versions = consecutive_versions(model, task, tokenizer, 4 if opts.quick else 8, rng)
    problems = task.sample(random.Random(1), 32 if opts.quick else 128)

    print(
        "\n| mode | in-flight tokens kept | wasted tokens | tokens/s | learner mean abs log-ratio | learner clipped frac | acceptance (gap 1) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    results = {}
    for mode in INFLIGHT_MODES:
        r = run_mode(mode, versions, task, tokenizer, problems, model.args)
        results[mode] = r
        acc = "–" if r["acceptance_gap1"] != r["acceptance_gap1"] else f"{r['acceptance_gap1']:.3f}"
        print(
            f"| {mode} | {r['kept_frac']:.3f} | {r['wasted_tokens']:.0f} | {r['tokens_per_s']:,.0f} | {r['abs_log_ratio']:.4f} | {r['clip_frac']:.4f} | {acc} |"
        )

    summary = {
        "salvaged_frac": round(results["verify_on_swap"]["kept_frac"], 4),
        "exact_pvalue": pvalues["verify_on_swap"],
        "exact_pvalue_on_finish": pvalues["verify_on_finish"],
        "keep_pvalue": pvalues["keep"],
        "quick": opts.quick,
        "seconds": round(time.perf_counter() - started, 1),
        **{
            f"{mode}_{k}": (round(v, 5) if v == v else None)
            for mode, r in results.items()
            for k, v in r.items()
        },
    }
    print(
        f"\nsalvaged_frac = {summary['salvaged_frac']:.3f}, exact_pvalue = {summary['exact_pvalue']:.3g}, "
        f"keep_pvalue = {summary['keep_pvalue']:.3g}, {summary['seconds']} s"
    )
    return cli.finish(summary, opts.json)


if __name__ == "__main__":
    sys.exit(main())

"""Stages 3 to 5 of the GPU check: lossless checks, the structured model and its warm-started
drafts, and the torch engine's rows against plain decoding."""

from __future__ import annotations

import copy
import functools
import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from actors.engines.torch.engine import TorchEngine
from benchmarks import _spec_rows, cli
from benchmarks.gpu_check import eagle as gpu_eagle
from benchmarks.gpu_check.plan import (
    LOSSLESS_ALPHA,
    PROMPT_SEED,
    TRAIN_SEED,
    WARMUP_SEED,
    Plan,
    Run,
)
from common import metric_names as mn
from common.config.actor import SpecConfig
from common.model import Transformer, attach_draft
from common.model_args import ModelArgs
from learner.prepare.draft_data import Decoding, WarmDraftOptions, draft_vocabulary, sample_group
from learner.prepare.draft_warmup import EXIT_FRACTION, held_out_acceptance, train_adapter
from testing.lossless_check import (
    ADAPTER_VOCAB,
    EOS,
    exact_sequence_logprobs,
    peaky_model,
    rollouts_pvalue,
    with_adapter,
)

# ------------------------------------------------------------------------------ engine rows


def methods(k: int, exit_layer: int) -> dict[str, SpecConfig]:
    """Plain decoding and each speculative method, fixed k and adaptive (``*_adaptive``)."""
    adapter = SpecConfig(
        method="early_exit", k=k, exit_layer=exit_layer, adapter=True, adaptive=False
    )
    fixed = {
        "ngram": SpecConfig(method="ngram", k=k, ngram_sources="group", adaptive=False),
        "early_exit": replace(adapter, adapter=False),
        "adapter": adapter,
        "hybrid": replace(adapter, method="hybrid", ngram_sources="group"),
    }
    rows = {"none": SpecConfig(method="none"), **fixed}
    rows.update({f"{name}_adaptive": replace(spec, adaptive=True) for name, spec in fixed.items()})
    return rows | gpu_eagle.methods(k)


def lossless(plan: Plan, device: torch.device, run: Run) -> dict[str, Any]:
    """Every row of :func:`methods` (k = 3, exit after layer 1 of 4, an adapter over part of the
    vocabulary) against the exact plain distribution of a 6-token model, on ``device``."""
    reference = with_adapter(
        peaky_model(vocab=6, seed=1, scale=8.0, layers=4),
        SpecConfig(method="early_exit", exit_layer=1, adapter=True),
        ADAPTER_VOCAB,
    )
    gpu_eagle.with_fresh_head(reference, ADAPTER_VOCAB)
    model = copy.deepcopy(reference).to(device)
    prompt, max_new = [1, 4, 5, 4], 3
    pvalues, rates = {}, {}
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        exact = exact_sequence_logprobs(reference, prompt, max_new, temperature, top_p, EOS)
        for name, spec in methods(3, 1).items():
            engine = TorchEngine(model, EOS, 0, temperature, top_p, seed=7, spec=spec)
            half = plan.lossless_samples // 2
            rollouts = [r for _ in range(2) for r in engine.generate([prompt], half, max_new)[0]]
            key = f"{name}_t{temperature}_p{top_p}"
            pvalues[key] = round(rollouts_pvalue(exact, rollouts), 5)
            rates[key] = round(engine.stats().get(mn.SPEC_ACCEPTANCE_RATE, 0.0), 3)
        run.say("lossless", f"t={temperature} top_p={top_p}: min p {min(pvalues.values()):.3g}")
    threshold = LOSSLESS_ALPHA / len(pvalues)
    return {
        "lossless": min(pvalues.values()) >= threshold,
        "lossless_threshold": threshold,
        "lossless_min_pvalue": min(pvalues.values()),
        "lossless_samples": 2 * (plan.lossless_samples // 2),
        "lossless_pvalues": pvalues,
        "lossless_acceptance": rates,
    }


@dataclass(frozen=True)
class Chain:
    """A random first-order Markov chain: token ``ids[i]`` is followed by ``ids[succ[i, j]]``
    with probability ``probs[i, j]`` (``fanout`` successors a token, Dirichlet(0.5) weights)."""

    ids: torch.Tensor  # [M]
    succ: torch.Tensor  # [M, F]
    probs: torch.Tensor  # [M, F]

    @classmethod
    def random(cls, vocab: int, size: int, fanout: int, first_id: int, seed: int) -> Chain:
        """``size`` distinct ids from ``first_id`` on (below: EOS, padding, BOS)."""
        rng = np.random.default_rng(seed)
        ids = first_id + rng.permutation(vocab - first_id)[:size]
        succ = np.stack([rng.permutation(size)[:fanout] for _ in range(size)])
        probs = rng.dirichlet([0.5] * fanout, size)
        return cls(torch.from_numpy(ids), torch.from_numpy(succ), torch.from_numpy(probs).float())

    def sample(self, rows: int, length: int, g: torch.Generator) -> tuple[torch.Tensor, float]:
        """[rows, length] token ids (CPU), and the mean -log p of their transitions (the loss
        of a model that knows the chain)."""
        state = torch.randint(len(self.ids), (rows,), generator=g)
        states, nll = [state], 0.0
        for _ in range(length - 1):
            j = torch.multinomial(self.probs[state], 1, generator=g)[:, 0]
            nll -= self.probs[state, j].log().sum().item()
            state = self.succ[state, j]
            states.append(state)
        return self.ids[torch.stack(states, 1)], nll / (rows * (length - 1))


def structure(
    plan: Plan, device: torch.device, run: Run
) -> tuple[dict[str, Any], Transformer, Chain]:
    """The engine model: random, trained briefly on the chain, its adapter warm-started from its
    own samples; returned in fp32 (the engines get a copy in ``plan.dtype``)."""
    args = ModelArgs(**plan.engine_shape)
    chain = Chain.random(args.vocab_size, plan.chain_size, plan.chain_fanout, 3, TRAIN_SEED)
    model = cli.random_model(device=device, **plan.engine_shape).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.structure_lr, weight_decay=0.0)
    warm = max(1, plan.structure_steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / warm)
            * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / plan.structure_steps))))
        ),
    )
    length = plan.prompt_len + plan.max_new
    g = torch.Generator().manual_seed(TRAIN_SEED)
    losses, floors, started = [], [], time.perf_counter()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    for step in range(plan.structure_steps):
        seqs, floor = chain.sample(plan.structure_batch, length, g)
        seqs = seqs.to(device)
        with autocast:
            logits = model(seqs[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), seqs[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        floors.append(floor)
        if (step + 1) % max(1, plan.structure_steps // 5) == 0:
            run.say("structure", f"step {step + 1}: loss {losses[-1]:.3f} (chain {floor:.3f})")
        if time.perf_counter() - started > plan.structure_budget_s:
            run.say("structure", f"time budget reached after {step + 1} steps")
            break
    train_s = time.perf_counter() - started
    model.eval().requires_grad_(False)
    del optimizer
    tail = max(1, len(losses) // 10)
    figures: dict[str, Any] = {
        "structure_chain_tokens": plan.chain_size,
        "structure_chain_fanout": plan.chain_fanout,
        "structure_steps": len(losses),
        "structure_seconds": round(train_s, 1),
        "structure_loss_first": round(losses[0], 4),
        "structure_loss_last": round(sum(losses[-tail:]) / tail, 4),
        "structure_chain_entropy": round(sum(floors) / len(floors), 4),
        "structure_uniform_loss": round(math.log(args.vocab_size), 4),
    }
    figures.update(warm_draft(plan, model, chain, run))
    return figures, model, chain


def warm_draft(plan: Plan, policy: Transformer, chain: Chain, run: Run) -> dict[str, Any]:
    """``specrl warm-draft``'s procedure (learner/prepare/draft_warmup.py) on chain prompts."""
    started = time.perf_counter()
    args = policy.args
    exit_layer = max(1, round(args.num_hidden_layers * EXIT_FRACTION))
    g = torch.Generator().manual_seed(WARMUP_SEED)
    prompts = chain.sample(plan.warmup_prompts, plan.prompt_len, g)[0].tolist()
    decoding = Decoding(plan.max_new, exit_layer, args.eos_token_id, 1.0, 1.0)
    device = policy.lm_head.weight.device
    sampler = copy.deepcopy(policy).to(plan.dtype) if plan.dtype != torch.float32 else policy
    generator = torch.Generator(device=device).manual_seed(WARMUP_SEED)
    samples = []
    for i in range(0, len(prompts), 32):
        samples += sample_group(sampler, prompts[i : i + 32], 2, decoding, generator)
    del sampler
    sample_s = time.perf_counter() - started
    held = max(2, len(samples) // 8)
    evaluation, train = samples[:held], samples[held:]
    ids = draft_vocabulary(
        [s.completion for s in train],
        [s.prompt for s in train],
        plan.draft_vocab if plan.draft_vocab < args.vocab_size else 0,
        args.vocab_size,
        {args.eos_token_id, args.pad_token_id},
    )
    attach_draft(policy, exit_layer, ids)
    opts = WarmDraftOptions(epochs=plan.warmup_epochs)
    before = held_out_acceptance(policy, evaluation, 1.0, opts.batch, opts.chunk)
    steps, loss = train_adapter(policy, train, opts, 1.0, WARMUP_SEED)
    after = held_out_acceptance(policy, evaluation, 1.0, opts.batch, opts.chunk)
    run.say("structure", f"draft acceptance {before:.3f} -> {after:.3f} ({steps} steps)")
    say = functools.partial(run.say, "structure")
    head = gpu_eagle.warm_head(policy, train, evaluation, ids, plan.warmup_epochs, say, WARMUP_SEED)
    return head | {
        "draft_exit_layer": exit_layer,
        "draft_vocab": int(ids.numel()) if ids is not None else args.vocab_size,
        "draft_train_samples": len(train),
        "draft_heldout_samples": len(evaluation),
        "draft_steps": steps,
        "draft_final_loss": round(loss, 4),
        "draft_acceptance_before": round(before, 4),
        "draft_acceptance_after": round(after, 4),
        "draft_sample_seconds": round(sample_s, 1),
        "draft_seconds": round(time.perf_counter() - started, 1),
    }


def _median(epochs: list[dict[str, float]], key: str) -> float:
    return statistics.median(e.get(key, 0.0) for e in epochs)


def engine_rows(
    plan: Plan, device: torch.device, run: Run, policy: Transformer, chain: Chain
) -> dict[str, Any]:
    """Every row at every batch size; the timed calls of the rows alternate, so a change in the
    machine's speed hits every row alike. A batch size is skipped once the budget is spent."""
    model = copy.deepcopy(policy).to(plan.dtype).eval()
    rows = methods(plan.k, model.args.draft_exit_layer)
    eos, pad = model.args.eos_token_id, model.args.pad_token_id
    flat: dict[str, Any] = {
        "gpu_k": plan.k,
        "gpu_max_new_tokens": plan.max_new,
        "gpu_rows": list(rows),
    }
    table, done, skipped = [], [], []
    g = torch.Generator().manual_seed(PROMPT_SEED)
    previous_s = 0.0
    for batch in plan.batches:
        if batch > 8 and run.left() < 2.5 * previous_s:
            skipped.append(batch)
            run.say("engine", f"batch {batch} skipped: {run.left():.0f}s of the budget left")
            continue
        started = time.perf_counter()
        n = 1 if batch == 1 else 8
        per_call = max(1, batch // n)
        warm_prompts = chain.sample(per_call, plan.prompt_len, g)[0].tolist()
        timed_prompts = chain.sample(per_call, plan.prompt_len, g)[0].tolist()
        engines = {}
        for name, spec in rows.items():
            engine = TorchEngine(model, eos, pad, 1.0, 1.0, seed=0, spec=spec)
            engine.generate(warm_prompts, n, plan.max_new)
            engine.stats()
            engines[name] = (engine, [])
        for _ in range(plan.timed_calls):
            for engine, epochs in engines.values():
                engine.generate(timed_prompts, n, plan.max_new)
                epochs.append(engine.stats())
        table += batch_figures(flat, engines, batch)
        done.append(batch)
        flat["gpu_batches"] = done
        previous_s = time.perf_counter() - started
        run.say("engine", f"batch {batch} in {previous_s:.1f}s\n" + "\n".join(table[-len(rows) :]))
        run.figures.update(flat)
        run.write()
    flat["gpu_batches"] = done
    flat["gpu_skipped_batches"] = skipped
    flat["gpu_table"] = TABLE_HEAD + table
    return flat


def batch_figures(flat: dict[str, Any], engines: dict, batch: int) -> list[str]:
    lines = []
    for name, key, epochs, speed, ratio in _spec_rows.speeds(flat, engines, batch, "gpu", _median):
        if name == "none":
            lines.append(f"| {batch} | none | {speed:,.1f} | 1.00x | - | - | - |")
            continue
        # An adaptive row that took plain steps only verified nothing: no figure (None).
        verified = _median(epochs, mn.SPEC_TOKENS_PER_VERIFY_FORWARD) > 0
        per_verify = _median(epochs, mn.SPEC_MEAN_ACCEPTED_LEN) if verified else None
        accept = _median(epochs, mn.SPEC_ACCEPTANCE_RATE) if verified else None
        flat[f"{key}_tokens_per_verify"] = None if per_verify is None else round(per_verify, 3)
        flat[f"{key}_acceptance"] = None if accept is None else round(accept, 3)
        lengths = _spec_rows.draft_lengths(epochs)
        if lengths:
            flat[f"{key}_draft_lengths"] = lengths
        cells = ["-" if v is None else f"{v:.2f}" for v in (accept, per_verify)]
        lines.append(
            f"| {batch} | {name} | {speed:,.1f} | {ratio:.2f}x | {cells[0]} | "
            f"{cells[1]} | {lengths or '-'} |"
        )
    return lines


TABLE_HEAD = [
    "| batch | method | tokens/s | vs none | acceptance | tokens per verify | draft lengths |",
    "| ---: | --- | ---: | ---: | ---: | ---: | --- |",
]


def summarise(figures: dict[str, Any]) -> dict[str, Any]:
    """The headline keys from the per-row figures (absent rows: absent keys)."""
    names = [n for n in methods(1, 1) if n != "none"]
    out: dict[str, Any] = {}
    if "gpu_none_b8_ratio" in figures:
        ratios = {n: figures[f"gpu_{n}_b8_ratio"] for n in names}
        best = max(ratios, key=ratios.__getitem__)
        out["gpu_best_method_b8"] = best
        out["gpu_speedup_b8_best"] = ratios[best]
        out["gpu_speedup_b8_best_lossless"] = ratios[best] if figures.get("lossless") else 0.0
        out["gpu_tokens_per_verify_b8"] = figures["gpu_adapter_b8_tokens_per_verify"]
        tpv = figures["gpu_eagle3_b8_tokens_per_verify"]
        out["gpu_eagle_tokens_per_verify_b8"] = tpv
        if tpv is not None and "eagle_draft_param_frac" in figures:
            # The memory-bound ceiling from the two measured figures: a bound, not a speed.
            frac = figures["eagle_draft_param_frac"]
            out["gpu_eagle_membound_bound_b8"] = round(tpv / (1 + figures["gpu_k"] * frac), 4)
    adaptive = [
        figures[f"gpu_{n}_b{b}_ratio"]
        for n in names
        if n.endswith("_adaptive")
        for b in figures.get("gpu_batches", [])
    ]
    if adaptive:
        out["gpu_adaptive_min_ratio"] = min(adaptive)
    return out

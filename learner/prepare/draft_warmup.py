"""``specrl warm-draft``: warm-start the policy's draft adapter (docs/design.md §2.1) before RL.

The model samples its own completions of the task's training prompts (plain decoding at the
run's sampling temperature and top-p, ``task.max_new_tokens``); the adapter's vocabulary is the
``spec.adapter_vocab`` tokens those completions use most; a fresh adapter after ``exit_layer``
layers (``attach_draft``: a copy of that layer and of the final norm) is trained teacher-forced
on them, only its parameters moving, on the learner's loss KL(p || q) (``learner.draft_loss``);
held-out prompts measure the acceptance before and after. The adapter is saved into the model
directory (``save_draft``: the model's own tensors untouched).

The frozen policy's states the loss reads (the residual stream after ``exit_layer`` layers and
the final-normed hidden state) are recorded while sampling, once per token, so training never
runs the policy. Sampling is the torch engine's plain step (``processed_logprobs`` and
``sample_tokens`` of ``common.sampling``) over a contiguous KV cache, finished rows leaving the
batch: the learner may not import the actors' engine (docs/design.md §1.2).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from common.config import SpecRLConfig
from common.config.actor import SpecConfig
from common.model import Transformer, attach_draft, save_draft
from common.sampling import processed_logprobs
from common.tokenizer import load_tokenizer
from learner.draft_loss import acceptance_sum, draft_states, loss_temperature
from learner.microbatch import over_chunks
from learner.prepare.draft_data import (
    WARMUP_LR,
    Sample,
    WarmDraftError,
    WarmDraftOptions,
    check_options,
    load_policy,
    pick_device,
    resolve_options,
    resolve_vocab,
    sample_for_warmup,
    save_into,
    torch_threads,
    train_draft,
    warm_threads,
    write_summary,
)
from learner.prepare.warm_start import ensure_model

log = logging.getLogger(__name__)

SUMMARY_FILE = "draft_warmup.json"
EXIT_FRACTION = 0.2
"""Default exit layer when ``spec.exit_layer`` is not set: this share of the layers, at least
1: layer 1 of the tiny model's 4, 6 of SmolLM2-135M's 30 (docs/training.md has the sweep)."""


def resolve_exit_layer(cfg: SpecRLConfig, num_layers: int, explicit: int | None) -> int:
    """``explicit`` (the user set ``spec.exit_layer``), else the config's unless it is the
    default, else :data:`EXIT_FRACTION` of the layers; refused outside [1, num_layers - 1]."""
    if explicit is None and cfg.spec.exit_layer != SpecConfig.exit_layer:
        explicit = cfg.spec.exit_layer
    exit_layer = max(1, round(num_layers * EXIT_FRACTION)) if explicit is None else explicit
    if not 1 <= exit_layer < num_layers:
        raise WarmDraftError(
            f"spec.exit_layer={exit_layer} is out of range: the adapter reads the residual stream "
            f"after 1 to {num_layers - 1} of the model's {num_layers} layers"
        )
    return exit_layer


def batch_states(samples: Sequence[Sample], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(h_exit [B, S, H] right-padded, mask [B, S] of the positions that predict a completion
    token, h_full [N, H] at those positions in the mask's row-major order)."""
    width = max(s.exit_states.shape[0] for s in samples)
    h_exit = torch.zeros((len(samples), width, samples[0].exit_states.shape[1]))
    mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for i, s in enumerate(samples):
        h_exit[i, : s.exit_states.shape[0]] = s.exit_states
        mask[i, len(s.prompt) - 1 : len(s.prompt) - 1 + len(s.completion)] = True
    h_full = torch.cat([s.full_states for s in samples])
    return h_exit.to(device), mask.to(device), h_full.to(device)


def restricted_kl_sum(
    policy: Transformer, h_full: Tensor, d: Tensor, temperature: float, chunk: int
) -> Tensor:
    """:func:`learner.draft_loss.adapter_kl_sum` from the head's draft-vocabulary rows only: p
    restricted to the vocabulary and renormalised is the softmax over those rows' logits, so the
    value and the adapter's gradient are the same, without the policy's [N, V] logits (computed
    twice there, with the recomputation in backward: 60% of a step for SmolLM2)."""
    t = loss_temperature(temperature)
    weight = policy.draft.head_weight(policy.lm_head.weight)

    def kl_sum(h: Tensor, d_part: Tensor) -> Tensor:
        with torch.no_grad():
            p = processed_logprobs(F.linear(h, weight).float(), t)
        q = processed_logprobs(F.linear(d_part, weight).float(), t)
        return (p.exp() * (p - q)).sum()

    parts = over_chunks(kl_sum, h_full.shape[0], chunk, False, lambda s: (h_full[s], d[s]))
    return sum(parts, d.new_zeros((), dtype=torch.float32))


def held_out_acceptance(
    policy: Transformer, samples: Sequence[Sample], temperature: float, batch: int, chunk: int
) -> float:
    """Mean per-token acceptance, sum_v min(p, q), of the policy's adapter over the completion
    positions of ``samples``."""
    total, positions = 0.0, 0
    device = policy.lm_head.weight.device
    with torch.no_grad():
        for i in range(0, len(samples), batch):
            h_exit, mask, h_full = batch_states(samples[i : i + batch], device)
            d = draft_states(policy, h_exit)[mask]
            total += float(acceptance_sum(policy, h_full, d, temperature, chunk))
            positions += int(mask.sum())
    return total / max(positions, 1)


def train_adapter(
    policy: Transformer,
    samples: list[Sample],
    opts: WarmDraftOptions,
    temperature: float,
    seed: int,
) -> tuple[int, float]:
    """Train the adapter teacher-forced on ``samples`` (:func:`train_draft`); returns (steps,
    mean loss of the last epoch)."""
    device = policy.lm_head.weight.device

    def batch_loss(part: list[Sample]) -> Tensor:
        h_exit, mask, h_full = batch_states(part, device)
        d = draft_states(policy, h_exit)[mask]
        return restricted_kl_sum(policy, h_full, d, temperature, opts.chunk) / len(h_full)

    lr = opts.lr or WARMUP_LR
    return train_draft(policy, policy.draft, samples, opts, lr, seed, batch_loss)


def warm_draft(cfg: SpecRLConfig, opts: WarmDraftOptions) -> tuple[Transformer, dict]:
    """Sample, pick the vocabulary, train, evaluate and save the adapter (module docstring);
    returns the policy with its trained adapter and the summary (also written as JSON). With
    ``spec.method=eagle3``: the EAGLE-3 head instead (``learner/prepare/eagle_warmup.py``)."""
    opts = resolve_options(opts, cfg.spec.uses_eagle)
    check_options(opts)
    with torch_threads(warm_threads(cfg, opts)):
        if cfg.spec.uses_eagle:
            from learner.prepare.eagle_warmup import warm_eagle  # builds on this module

            return warm_eagle(cfg, opts, time.perf_counter())
        return _warm_draft(cfg, opts, time.perf_counter())


def _warm_draft(
    cfg: SpecRLConfig, opts: WarmDraftOptions, started: float
) -> tuple[Transformer, dict]:
    device = pick_device(opts.device)
    model_dir = ensure_model(cfg)
    policy = load_policy(model_dir, device)
    args = policy.args
    exit_layer = resolve_exit_layer(cfg, args.num_hidden_layers, opts.exit_layer)
    vocab = resolve_vocab(cfg, args.vocab_size, opts.vocab)
    log.info("warm-draft %s: exit layer %d of %d", model_dir, exit_layer, args.num_hidden_layers)
    data = sample_for_warmup(
        cfg, opts, policy, load_tokenizer(model_dir), exit_layer, vocab, model_dir
    )
    temperature = cfg.sampling.temperature
    attach_draft(policy, exit_layer, data.vocab_ids)
    before = held_out_acceptance(policy, data.evaluation, temperature, opts.batch, opts.chunk)
    log.info(
        "held-out acceptance before training %.4f, vocabulary coverage %.4f", before, data.coverage
    )
    steps, loss = train_adapter(policy, data.train, opts, temperature, cfg.run.seed)
    after = held_out_acceptance(policy, data.evaluation, temperature, opts.batch, opts.chunk)
    out = save_into(policy, model_dir, opts.out, save_draft)
    own = {
        "model_dir": str(out),
        "exit_layer": exit_layer,
        "num_layers": args.num_hidden_layers,
        "draft_vocab": vocab or args.vocab_size,
        "vocab_size": args.vocab_size,
    }
    trained = {
        "steps": steps,
        "lr": opts.lr or WARMUP_LR,
        "final_loss": round(loss, 4),
        "acceptance_before": round(before, 4),
        "acceptance_after": round(after, 4),
    }
    return policy, write_summary(cfg, opts, data, own, trained, out / SUMMARY_FILE, started)

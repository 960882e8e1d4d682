"""The policy's EAGLE-3 head in the GPU check (benchmarks/gpu_check/): warm-started on the
engine model as ``specrl warm-draft spec=eagle3`` does (learner/prepare/eagle_warmup.py's functions),
from the very samples and draft vocabulary the adapter's warm start used, then run by the torch
engine as the rows ``eagle3`` (k fixed) and ``eagle3_adaptive`` beside the adapter's.

Imports only what the lent machine has (torch, numpy, safetensors): no config loading here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from common.config.actor import SpecConfig
from common.eagle import attach_eagle
from common.model import Transformer
from learner.prepare.draft_data import WARMUP_LR, Sample, WarmDraftOptions
from learner.prepare.eagle_warmup import held_out_acceptance, teacher_states, train_head


def methods(k: int) -> dict[str, SpecConfig]:
    """The head's rows: k fixed, and the adaptive draft length (k the most)."""
    adaptive = SpecConfig(method="eagle3", k=k)
    return {"eagle3": replace(adaptive, adaptive=False), "eagle3_adaptive": adaptive}


def warm_head(
    policy: Transformer,
    train: Sequence[Sample],
    evaluation: Sequence[Sample],
    vocab_ids: torch.Tensor | None,
    epochs: int,
    say: Callable[[str], None],
    seed: int,
) -> dict[str, Any]:
    """Attach a fresh head to ``policy`` (drafting over ``vocab_ids``; None: all), train it on
    ``train`` at temperature 1 and measure its held-out acceptance before and after; figures
    under ``eagle_*``."""
    attach_eagle(policy, vocab_ids=vocab_ids, seed=seed)
    opts = WarmDraftOptions(epochs=epochs)
    records = teacher_states(policy, train, opts.batch)
    held = teacher_states(policy, evaluation, opts.batch)
    before = held_out_acceptance(policy, held, 1.0, opts.batch, opts.chunk)
    steps, loss = train_head(policy, records, opts, WARMUP_LR, 1.0, seed)
    after = held_out_acceptance(policy, held, 1.0, opts.batch, opts.chunk)
    policy.eval().requires_grad_(False)
    say(f"EAGLE-3 head acceptance {before:.3f} -> {after:.3f} ({steps} steps)")
    head = policy.eagle
    target = (
        sum(p.numel() for p in policy.model.layers.parameters()) + policy.lm_head.weight.numel()
    )
    per_draft = sum(p.numel() for p in head.parameters())
    return {
        "eagle_aux_layers": list(policy.args.eagle_aux_layers),
        "eagle_draft_vocab": policy.args.eagle_vocab_size or policy.args.vocab_size,
        "eagle_steps": steps,
        "eagle_final_loss": round(loss, 4),
        "eagle_acceptance_before": round(before, 4),
        "eagle_acceptance_after": round(after, 4),
        # The head's parameters (fc, its layer, norm, LM head) over the target's decoder layers
        # and LM head: the share of a target forward's reads one draft token reads.
        "eagle_draft_param_frac": round(per_draft / target, 5),
    }


def with_fresh_head(model: Transformer, vocab: Sequence[int], seed: int = 0) -> Transformer:
    """``model`` with an untrained head over ``vocab`` (the lossless check needs a q, not a good
    one); returns ``model``."""
    attach_eagle(model, vocab_ids=torch.tensor(sorted(vocab)), seed=seed)
    return model.eval()

"""``specrl warm-draft spec.method=eagle3``: warm-start the policy's EAGLE-3 head (common/eagle.py)
before RL, as ``learner/prepare/draft_warmup.py`` warm-starts the draft adapter.

The model samples its own completions of the task's training prompts (``draft_warmup``'s
sampling: plain decoding at the run's temperature and top-p); the head's vocabulary is the
``spec.eagle_vocab`` tokens those completions use most (``draft_warmup.draft_vocabulary``); a
fresh head (``attach_eagle``: vLLM's inputs, the policy's LM-head rows and final norm) is trained
teacher-forced on them, only its parameters moving, on the learner's loss (the head at t, fed
the auxiliary states at t and token t+1, toward the policy's distribution at t+1,
``learner/eagle_loss.py``); held-out prompts measure the acceptance before and after. The head is
saved into the model directory (``eagle/model.safetensors`` and its two keys in
``config.json``), the model's own tensors untouched.

The frozen policy's states the loss reads (the auxiliary states and the final-normed hidden
states) come from one teacher-forced float32 forward per sequence after sampling, so training
never runs the policy.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from common.config import SpecRLConfig
from common.config.actor import SpecConfig
from common.eagle import EAGLE_FILE, EAGLE_PREFIX, attach_eagle
from common.model import Transformer, save_part
from common.sampling import processed_logprobs
from common.tokenizer import load_tokenizer
from learner.draft_loss import loss_temperature
from learner.eagle_loss import eagle_kl_terms, eagle_states, unrolled_states
from learner.microbatch import over_chunks
from learner.prepare.draft_data import (
    WARMUP_LR,
    Sample,
    WarmDraftOptions,
    load_policy,
    pick_device,
    resolve_vocab,
    sample_for_warmup,
    save_into,
    train_draft,
    write_summary,
)
from learner.prepare.warm_start import ensure_model

log = logging.getLogger(__name__)

EAGLE_SUMMARY_FILE = "eagle_warmup.json"


@dataclass
class HeadSample:
    """One sampled completion and the frozen policy's states the head's loss reads."""

    prompt: list[int]
    completion: list[int]
    aux: Tensor
    """[P + C - 1, n·H] float32: the auxiliary states (concatenated in layer order) at positions
    0 .. P + C - 2."""
    full: Tensor
    """[C, H] float32: the final-normed hidden states at positions P - 1 .. P + C - 2."""

    @property
    def ids(self) -> list[int]:
        """The tokens at positions 0 .. P + C - 2."""
        return self.prompt + self.completion[:-1]


def resolve_eagle_vocab(cfg: SpecRLConfig, vocab_size: int, explicit: int | None) -> int:
    """The head's vocabulary size, 0 for the whole vocabulary: ``explicit``, else
    ``spec.eagle_vocab`` when set (both refused above the vocabulary), else the default capped at
    the vocabulary."""
    if explicit is None and cfg.spec.eagle_vocab != SpecConfig.eagle_vocab:
        explicit = cfg.spec.eagle_vocab
    return resolve_vocab(cfg, vocab_size, explicit, "eagle_vocab")


@torch.no_grad()
def teacher_states(policy: Transformer, samples: Sequence[Sample], batch: int) -> list[HeadSample]:
    """The head's training records of ``samples``: one teacher-forced forward of the (float32)
    policy over each prompt + completion, ``batch`` sequences at a time (right-padded). The
    policy has its head already (its ``eagle_aux_layers`` are the states recorded)."""
    if not policy.args.has_eagle:
        raise ValueError("attach the EAGLE-3 head first: its inputs are what is recorded")
    device, out = policy.lm_head.weight.device, []
    L = policy.args.num_hidden_layers
    for i in range(0, len(samples), batch):
        part = samples[i : i + batch]
        seqs = [s.prompt + s.completion[:-1] for s in part]
        ids = torch.zeros((len(seqs), max(map(len, seqs))), dtype=torch.long, device=device)
        for j, seq in enumerate(seqs):
            ids[j, : len(seq)] = torch.tensor(seq, device=device)
        aux: list[Tensor] = []
        h = policy.model.norm(
            policy.run_layers(policy.model.embed_tokens(ids), None, None, 0, L, aux=aux)
        )
        cat = torch.cat(aux, dim=-1)
        for j, s in enumerate(part):
            n, p = len(seqs[j]), len(s.prompt)
            out.append(
                HeadSample(
                    s.prompt, s.completion, cat[j, :n].float().cpu(), h[j, p - 1 : n].float().cpu()
                )
            )
    return out


def batch_inputs(
    samples: Sequence[HeadSample], device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(ids [B, S], aux [B, S, n·H], mask [B, S-1] of the head positions t whose t+1 predicts a
    completion token, the policy's final-normed states at those t+1 [N, H] in the mask's
    row-major order), right-padded."""
    width = max(len(s.ids) for s in samples)
    ids = torch.zeros((len(samples), width), dtype=torch.long)
    aux = torch.zeros((len(samples), width, samples[0].aux.shape[1]))
    mask = torch.zeros((len(samples), max(width - 1, 0)), dtype=torch.bool)
    targets = []
    for i, s in enumerate(samples):
        n, p = len(s.ids), len(s.prompt)
        ids[i, :n], aux[i, :n] = torch.tensor(s.ids), s.aux
        first = max(p - 2, 0)  # the head at t is taught the policy's position t + 1 >= P - 1
        mask[i, first : n - 1] = True
        targets.append(s.full[first - (p - 2) :])
    return ids.to(device), aux.to(device), mask.to(device), torch.cat(targets).to(device)


def restricted_kl_sum(
    policy: Transformer, h_next: Tensor, prenorm: Tensor, temperature: float, chunk: int
) -> Tensor:
    """The learner's KL sum (``eagle_loss.eagle_kl_terms``) from the policy's LM-head rows of the
    head's vocabulary only: p restricted and renormalised is the softmax over those rows'
    logits, so the value and the head's gradient are the same without the [N, V] logits."""
    t = loss_temperature(temperature)
    head = policy.eagle
    weight = policy.lm_head.weight.index_select(0, head.vocab_ids).detach()

    def kl_sum(h: Tensor, d: Tensor) -> Tensor:
        with torch.no_grad():
            p = processed_logprobs(F.linear(h, weight).float(), t)
        q = processed_logprobs(head.logits(d), t)
        return (p.exp() * (p - q)).sum()

    parts = over_chunks(kl_sum, h_next.shape[0], chunk, False, lambda s: (h_next[s], prenorm[s]))
    return sum(parts, prenorm.new_zeros((), dtype=torch.float32))


def head_outputs(
    policy: Transformer, part: Sequence[HeadSample], steps: int = 1
) -> list[tuple[Tensor, Tensor]]:
    """Per draft step (1 .. ``steps``, at most 2) of a batch: (the policy's states the step
    predicts [N, H], the head's outputs for them [N, H]). Step 1: the head at t toward the
    policy at t+1; step 2 (``eagle_loss.unrolled_states``): the head reading its own step-1
    output at t and the token at t+2, toward the policy at t+2, as the second token of a draft
    chain is drafted."""
    device = policy.lm_head.weight.device
    ids, aux, mask, h_next = batch_inputs(part, device)
    first = eagle_states(policy, ids, [aux])
    out = [(h_next, first[mask])]
    if steps >= 2:
        second = unrolled_states(policy, ids, [aux], first)  # [B, S-2, H]
        mask2 = torch.zeros(second.shape[:2], dtype=torch.bool)
        targets = []
        for i, s in enumerate(part):
            n, p = len(s.ids), len(s.prompt)
            low = max(p - 3, 0)  # entry t is taught the policy's position t + 2 >= P - 1
            mask2[i, low : n - 2] = True
            targets.append(s.full[low + 3 - p :])
        out.append((torch.cat(targets).to(device), second[mask2.to(device)]))
    return out


def held_out_acceptance(
    policy: Transformer,
    samples: Sequence[HeadSample],
    temperature: float,
    batch: int,
    chunk: int,
    step: int = 1,
) -> float:
    """Mean per-token acceptance, sum_v min(p, q), of the policy's head at draft step ``step``
    (1 or 2, teacher-forced: :func:`head_outputs`) over ``samples``."""
    total, positions = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(samples), batch):
            h_next, prenorm = head_outputs(policy, samples[i : i + batch], step)[step - 1]
            total += float(eagle_kl_terms(policy, h_next, prenorm, temperature, chunk)[1])
            positions += h_next.shape[0]
    return total / max(positions, 1)


def train_head(
    policy: Transformer,
    samples: list[HeadSample],
    opts: WarmDraftOptions,
    lr: float,
    temperature: float,
    seed: int,
    draft_steps: int = 1,
) -> tuple[int, float]:
    """Train the head teacher-forced on ``draft_steps`` draft steps (``spec.eagle_steps``: the
    KL of each, summed, over the first step's positions, as the learner's loss), with the
    adapter's schedule (``draft_warmup.train_draft``); returns (steps, mean loss of the last
    epoch)."""

    def batch_loss(part: list[HeadSample]) -> Tensor:
        parts = head_outputs(policy, part, draft_steps)
        loss = sum(restricted_kl_sum(policy, *p, temperature, opts.chunk) for p in parts)
        return loss / max(parts[0][0].shape[0], 1)

    return train_draft(policy, policy.eagle, samples, opts, lr, seed, batch_loss)


def save_eagle(model: Transformer, path: str | Path) -> None:
    """Write the EAGLE-3 head of ``model`` into the existing checkpoint directory ``path``
    (``eagle/model.safetensors``, and its two keys in ``config.json``), leaving the model's own
    tensors as they are; the head's floating tensors take the checkpoint's dtype."""
    if model.eagle is None:
        raise ValueError("the model has no EAGLE-3 head to save")
    save_part(
        path,
        model.eagle,
        EAGLE_PREFIX,
        EAGLE_FILE,
        eagle_aux_layers=list(model.args.eagle_aux_layers),
        eagle_vocab_size=model.args.eagle_vocab_size,
    )


def warm_eagle(
    cfg: SpecRLConfig, opts: WarmDraftOptions, started: float
) -> tuple[Transformer, dict]:
    """Sample, pick the vocabulary, train, evaluate and save the head (module docstring);
    returns the policy with its trained head and the summary (also written as JSON)."""
    policy, model_dir = _load(cfg, opts)
    args = policy.args
    vocab = resolve_eagle_vocab(cfg, args.vocab_size, opts.vocab)
    exit_layer = min(1, args.num_hidden_layers)  # the sampler's split: any layer will do
    data = sample_for_warmup(cfg, opts, policy, load_tokenizer(model_dir), exit_layer, vocab)
    temperature = cfg.sampling.temperature
    attach_eagle(policy, vocab_ids=data.vocab_ids, seed=cfg.run.seed)  # its inputs: what to record
    evaluation = teacher_states(policy, data.evaluation, opts.batch)
    train = teacher_states(policy, data.train, opts.batch)
    before = held_out_acceptance(policy, evaluation, temperature, opts.batch, opts.chunk)
    log.info(
        "held-out acceptance before training %.4f, vocabulary coverage %.4f", before, data.coverage
    )
    lr = opts.lr or (cfg.spec.eagle_lr if cfg.spec.eagle_lr != SpecConfig.eagle_lr else WARMUP_LR)
    draft_steps = cfg.spec.eagle_steps
    steps, loss = train_head(policy, train, opts, lr, temperature, cfg.run.seed, draft_steps)
    after = held_out_acceptance(policy, evaluation, temperature, opts.batch, opts.chunk)
    second = held_out_acceptance(policy, evaluation, temperature, opts.batch, opts.chunk, 2)
    out = save_into(policy, model_dir, opts.out, save_eagle)
    own = {
        "model_dir": str(out),
        "method": "eagle3",
        "aux_layers": list(policy.args.eagle_aux_layers),
        "num_layers": args.num_hidden_layers,
        "draft_vocab": vocab or args.vocab_size,
        "vocab_size": args.vocab_size,
    }
    trained = {
        "steps": steps,
        "lr": lr,
        "final_loss": round(loss, 4),
        "acceptance_before": round(before, 4),
        "acceptance_after": round(after, 4),
        "draft_steps_trained": draft_steps,
        "acceptance_after_step2": round(second, 4),
    }
    summary = write_summary(cfg, opts, data, own, trained, out / EAGLE_SUMMARY_FILE, started)
    return policy, summary


def _load(cfg: SpecRLConfig, opts: WarmDraftOptions) -> tuple[Transformer, Path]:
    """The float32 policy of the run's model directory (built first if need be) and the
    directory."""
    model_dir = ensure_model(cfg)
    policy = load_policy(model_dir, pick_device(opts.device))
    log.info(
        "warm-draft (eagle3) %s: %d layers, %d prompts x %d completions",
        model_dir,
        policy.args.num_hidden_layers,
        opts.prompts,
        opts.samples_per_prompt,
    )
    return policy, model_dir

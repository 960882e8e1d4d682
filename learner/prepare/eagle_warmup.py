"""``specrl warm-draft spec.method=eagle3``: warm-start the policy's EAGLE-3 head (common/eagle.py)
before RL, as ``learner/prepare/draft_warmup.py`` warm-starts the draft adapter.

The model samples its own completions of the task's training prompts (``draft_warmup``'s
sampling: plain decoding at the run's temperature and top-p; by default 1024 prompts of the
task's pool x 2, 12.5% held out); the head's vocabulary is the ``spec.eagle_vocab`` tokens those
completions use most (``draft_warmup.draft_vocabulary``); a fresh head (``attach_eagle``: vLLM's
inputs, the policy's LM-head rows and final norm, its layer the policy's last one applied to the
top auxiliary state) is trained teacher-forced on them, only its parameters moving, on the
learner's loss over ``spec.eagle_steps`` draft steps (default ``spec.k``: EAGLE-3's
training-time test, step j weighted ``spec.eagle_step_decay ** (j-1)``,
``learner/eagle_loss.py``). Held-out prompts measure the acceptance at each draft step 1..k
before and after, and calibrate the draft sharpening s (``EagleHead.sharpening``) that gives
the most tokens per verify. The head is saved into the model directory
(``eagle/model.safetensors``, its LM head sharpened, and its keys in ``config.json``), the
model's own tensors untouched.

The frozen policy's states the loss reads (the auxiliary states, kept in bf16, and the
restricted target distribution: its top ``TARGET_TOP`` draft tokens and the rest's mass) come
from one teacher-forced forward per sequence after sampling (a bf16 copy of the policy, the
``--sample-dtype``; the held-out samples' in float32, for the exact acceptance), so training
never runs the policy nor its LM head.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from common.config import SpecRLConfig
from common.config.actor import SpecConfig
from common.eagle import (
    EAGLE_FILE,
    EAGLE_PREFIX,
    EAGLE_SHARPENING_KEY,
    EagleHead,
    attach_eagle,
)
from common.model import Transformer, save_part
from common.sampling import processed_logprobs
from common.tokenizer import load_tokenizer
from learner.draft_loss import loss_temperature
from learner.eagle_loss import step_weights, ttt_states
from learner.prepare.draft_data import (
    WARMUP_LR,
    Sample,
    WarmDraftOptions,
    load_policy,
    pick_device,
    resolve_vocab,
    sample_for_warmup,
    sampling_copy,
    save_into,
    train_draft,
    write_summary,
)
from learner.prepare.warm_start import ensure_model

log = logging.getLogger(__name__)

EAGLE_SUMMARY_FILE = "eagle_warmup.json"
TARGET_TOP = 64
"""Draft tokens of the restricted target p kept per position (with the rest's mass): at
SmolLM2's T = 0.5 they hold nearly all of it."""
SHARPENINGS = (1.0, 0.85, 0.7, 0.5)
"""The draft sharpenings s the warm start calibrates on the held-out samples."""


@dataclass
class HeadSample:
    """One sampled completion and the frozen policy's states the head's loss reads."""

    prompt: list[int]
    completion: list[int]
    aux: Tensor
    """[P + C - 1, n·H] (bf16 for training records): the auxiliary states (concatenated in layer order) at positions
    0 .. P + C - 2."""
    full: Tensor | None
    """[C, H] float32: the final-normed hidden states at positions P - 1 .. P + C - 2 (held-out
    samples: the exact acceptance reads them)."""
    top_ids: Tensor | None = None
    """[C, TARGET_TOP] draft ids: the restricted target's most likely at those positions."""
    top_logp: Tensor | None = None
    """[C, TARGET_TOP] their log-probabilities, p restricted to the draft vocabulary."""
    rest: Tensor | None = None
    """[C] the log of the rest's mass (at most 0)."""

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
def teacher_states(
    policy: Transformer,
    samples: Sequence[Sample],
    batch: int,
    temperature: float | None = None,
    aux_dtype: torch.dtype = torch.float32,
    forward: Transformer | None = None,
) -> list[HeadSample]:
    """The head's training records of ``samples``: one teacher-forced forward of the (float32)
    policy over each prompt + completion, ``batch`` sequences at a time (right-padded). The
    policy has its head already (its ``eagle_aux_layers`` are the states recorded). With
    ``temperature``: the restricted targets are cached (:func:`cache_targets`) and the states
    behind them dropped (training records); without, kept (held-out records). The auxiliary
    states are kept in ``aux_dtype`` (bf16 halves the training records' memory). ``forward``: the
    model whose forward records the states (the warm start's training records: a bf16 copy of
    the policy, twice as fast on a CPU with bf16 instructions, and the dtype actors decode in);
    default the policy itself. The targets are always computed in float32 from its states."""
    if not policy.args.has_eagle:
        raise ValueError("attach the EAGLE-3 head first: its inputs are what is recorded")
    model = policy if forward is None else forward
    device, out = policy.lm_head.weight.device, []
    L = policy.args.num_hidden_layers
    started = time.perf_counter()
    for i in range(0, len(samples), batch):
        part = samples[i : i + batch]
        seqs = [s.prompt + s.completion[:-1] for s in part]
        ids = torch.zeros((len(seqs), max(map(len, seqs))), dtype=torch.long, device=device)
        for j, seq in enumerate(seqs):
            ids[j, : len(seq)] = torch.tensor(seq, device=device)
        aux: list[Tensor] = []
        h = model.model.norm(
            model.run_layers(model.model.embed_tokens(ids), None, None, 0, L, aux=aux)
        )
        cat = torch.cat(aux, dim=-1)
        for j, s in enumerate(part):
            n, p = len(seqs[j]), len(s.prompt)
            record = HeadSample(
                s.prompt,
                s.completion,
                cat[j, :n].to("cpu", aux_dtype),
                h[j, p - 1 : n].float(),
            )
            if temperature is not None:
                cache_targets(policy, record, temperature)
            record.full = None if temperature is not None else record.full.cpu()
            out.append(record)
        if (i // batch) % 32 == 31:
            elapsed = time.perf_counter() - started
            log.info(
                "teacher states: %d/%d sequences, elapsed %.0fs, ETA %.0fs",
                len(out),
                len(samples),
                elapsed,
                elapsed / len(out) * (len(samples) - len(out)),
            )
    return out


@torch.no_grad()
def cache_targets(policy: Transformer, record: HeadSample, temperature: float) -> None:
    """``record``'s restricted target at each completion position, once: p over the head's
    vocabulary at the loss temperature, its top ``TARGET_TOP`` ids and log-probabilities and
    the log of the rest's mass (training never recomputes the policy's logits)."""
    head = policy.eagle
    weight = policy.lm_head.weight.index_select(0, head.vocab_ids)
    p = processed_logprobs(F.linear(record.full, weight).float(), loss_temperature(temperature))
    top = min(TARGET_TOP, p.shape[-1])
    logp, ids = p.topk(top, dim=-1)
    mass = logp.exp().sum(-1).clamp(max=1.0)
    record.top_ids, record.top_logp = ids.to(torch.int32).cpu(), logp.cpu()
    record.rest = torch.log1p(-mass).clamp(min=-1e4).cpu()


def step_rows(samples: Sequence[HeadSample], width: int, step: int) -> tuple[Tensor, list[slice]]:
    """Draft step ``step``'s training entries of a batch: the mask [B, width - step] of the entries
    t whose target, the policy's position t + step, predicts a completion token (t + step >=
    P - 1), and per sample the slice of its completion positions (rows of ``full`` or of the
    cached targets) they are taught, in order."""
    mask = torch.zeros((len(samples), max(width - step, 0)), dtype=torch.bool)
    rows = []
    for i, s in enumerate(samples):
        n, p = len(s.ids), len(s.prompt)
        low = max(p - 1 - step, 0)
        mask[i, low : n - step] = True
        rows.append(slice(low + step - (p - 1), None))
    return mask, rows


def batch_inputs(samples: Sequence[HeadSample], device: torch.device) -> tuple[Tensor, Tensor]:
    """(ids [B, S], aux [B, S, n·H] float32), right-padded."""
    width = max(len(s.ids) for s in samples)
    ids = torch.zeros((len(samples), width), dtype=torch.long)
    aux = torch.zeros((len(samples), width, samples[0].aux.shape[1]))
    for i, s in enumerate(samples):
        n = len(s.ids)
        ids[i, :n], aux[i, :n] = torch.tensor(s.ids), s.aux.float()
    return ids.to(device), aux.to(device)


def head_outputs(
    policy: Transformer, part: Sequence[HeadSample], steps: int = 1
) -> list[tuple[Tensor, list[slice]]]:
    """Per draft step j = 1 .. ``steps`` of a batch (``eagle_loss.ttt_states``): the head's
    outputs at the entries that have a target [N_j, H] and, per sample, the slice of its
    completion positions they predict (:func:`step_rows`)."""
    device = policy.lm_head.weight.device
    ids, aux = batch_inputs(part, device)
    out = []
    for j, states in enumerate(ttt_states(policy, ids, [aux], steps), start=1):
        mask, rows = step_rows(part, ids.shape[1], j)
        out.append((states[:, : mask.shape[1]][mask.to(device)], rows))
    return out


def cached_kl_sum(
    head: EagleHead, part: Sequence[HeadSample], rows, prenorm, temperature
) -> Tensor:
    """Sum over the step's N positions of KL(p || q) between the cached restricted target (its
    top tokens and the rest lumped) and the head's trained q lumped the same way."""
    device = prenorm.device
    ids = torch.cat([s.top_ids[r] for s, r in zip(part, rows, strict=True)]).to(device).long()
    logp = torch.cat([s.top_logp[r] for s, r in zip(part, rows, strict=True)]).to(device)
    rest = torch.cat([s.rest[r] for s, r in zip(part, rows, strict=True)]).to(device)
    q = processed_logprobs(head.trained_logits(prenorm), loss_temperature(temperature))
    q_top = q.gather(-1, ids)
    q_rest = torch.log1p(-q_top.exp().sum(-1).clamp(max=1.0 - 1e-6))
    kl = (logp.exp() * (logp - q_top)).sum() + (rest.exp() * (rest - q_rest)).sum()
    return kl


def acceptance_by_step(
    policy: Transformer,
    samples: Sequence[HeadSample],
    temperature: float,
    batch: int,
    steps: int = 1,
    sharpenings: Sequence[float] = (1.0,),
    chunk: int = 256,
) -> dict[float, list[float]]:
    """Per draft sharpening s, the mean per-token acceptance sum_v min(p, q_s) at each draft
    step 1 .. ``steps`` (teacher-forced, :func:`head_outputs`) over ``samples`` (records with
    their states), p the policy's unrestricted distribution at ``temperature`` (its logits
    ``chunk`` positions at a time) and q_s the head's trained logits over T·s."""
    head = policy.eagle
    ids = head.vocab_ids
    totals = {s: [0.0] * steps for s in sharpenings}
    counts = [0] * steps
    with torch.no_grad():
        for i in range(0, len(samples), batch):
            part = samples[i : i + batch]
            for j, (prenorm, rows) in enumerate(head_outputs(policy, part, steps)):
                h = torch.cat([s.full[r] for s, r in zip(part, rows, strict=True)])
                h = h.to(prenorm.device)
                for c in range(0, h.shape[0], max(chunk, 1)):
                    part_h, part_d = h[c : c + chunk], prenorm[c : c + chunk]
                    p = processed_logprobs(policy.lm_head(part_h).float(), temperature)
                    p = p.exp()[:, ids]
                    logits = head.trained_logits(part_d)
                    for s in sharpenings:
                        q = processed_logprobs(logits / s, temperature).exp()
                        totals[s][j] += float(torch.minimum(p, q).sum())
                counts[j] += h.shape[0]
    return {s: [t / max(n, 1) for t, n in zip(v, counts, strict=True)] for s, v in totals.items()}


def held_out_acceptance(
    policy: Transformer,
    samples: Sequence[HeadSample],
    temperature: float,
    batch: int,
    chunk: int = 256,
    step: int = 1,
) -> float:
    """Mean per-token acceptance, sum_v min(p, q), of the head as it drafts (its sharpening
    included) at draft step ``step`` over ``samples`` (:func:`acceptance_by_step`)."""
    s = policy.eagle.sharpening
    return acceptance_by_step(policy, samples, temperature, batch, step, (s,), chunk)[s][step - 1]


def chain_estimate(acceptance: Sequence[float]) -> float:
    """Tokens per verify of a chain whose step j is accepted at rate a_j given the earlier ones
    were: 1 + sum_j prod_{i<=j} a_i."""
    total, reach = 1.0, 1.0
    for a in acceptance:
        reach *= a
        total += reach
    return total


def train_head(
    policy: Transformer,
    samples: list[HeadSample],
    opts: WarmDraftOptions,
    lr: float,
    temperature: float,
    seed: int,
    draft_steps: int = 1,
    decay: float = 1.0,
) -> tuple[int, float]:
    """Train the head teacher-forced on ``draft_steps`` draft steps (``spec.eagle_steps``: step
    j's KL weighted ``decay ** (j-1)``, summed, over the first step's positions, as the
    learner's loss) against the cached targets, with the adapter's schedule
    (``draft_warmup.train_draft``); returns (steps, mean loss of the last epoch)."""
    weights = step_weights(draft_steps, decay)
    for record in samples:
        if record.top_ids is None:  # records made without a temperature: cache them now
            cache_targets(policy, record, temperature)

    def batch_loss(part: list[HeadSample]) -> Tensor:
        outs = head_outputs(policy, part, draft_steps)
        loss = sum(
            w * cached_kl_sum(policy.eagle, part, rows, prenorm, temperature)
            for w, (prenorm, rows) in zip(weights, outs, strict=False)
        )
        return loss / max(outs[0][0].shape[0], 1)

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
        **{SHARPENING_KEY: model.eagle.sharpening},
    )


SHARPENING_KEY = EAGLE_SHARPENING_KEY


def warm_eagle(
    cfg: SpecRLConfig, opts: WarmDraftOptions, started: float
) -> tuple[Transformer, dict]:
    """Sample, pick the vocabulary, train, evaluate, calibrate the sharpening and save the head
    (module docstring); returns the policy with its trained head and the summary (also written
    as JSON)."""
    policy, model_dir = _load(cfg, opts)
    args = policy.args
    vocab = resolve_eagle_vocab(cfg, args.vocab_size, opts.vocab)
    exit_layer = min(1, args.num_hidden_layers)  # the sampler's split: any layer will do
    data = sample_for_warmup(
        cfg, opts, policy, load_tokenizer(model_dir), exit_layer, vocab, model_dir
    )
    temperature, k = cfg.sampling.temperature, cfg.spec.k
    attach_eagle(policy, vocab_ids=data.vocab_ids, seed=cfg.run.seed)  # its inputs: what to record
    evaluation = teacher_states(policy, data.evaluation, opts.batch)
    fast = sampling_copy(policy, opts.sample_dtype)  # bf16 unless --sample-dtype float32
    train = teacher_states(policy, data.train, opts.batch, temperature, torch.bfloat16, fast)
    del fast
    before = acceptance_by_step(policy, evaluation, temperature, opts.batch, k)[1.0]
    log.info(
        "held-out acceptance by draft step before training %s, vocabulary coverage %.4f",
        [round(a, 4) for a in before],
        data.coverage,
    )
    lr = opts.lr or (cfg.spec.eagle_lr if cfg.spec.eagle_lr != SpecConfig.eagle_lr else WARMUP_LR)
    draft_steps, decay = cfg.spec.eagle_train_steps, cfg.spec.eagle_step_decay
    steps, loss = train_head(policy, train, opts, lr, temperature, cfg.run.seed, draft_steps, decay)
    after = acceptance_by_step(policy, evaluation, temperature, opts.batch, k, SHARPENINGS)
    chains = {s: chain_estimate(a) for s, a in after.items()}
    sharpening = max(SHARPENINGS, key=lambda s: (round(chains[s], 6), s))
    log.info(
        "held-out acceptance by draft step after training %s; tokens per verify by sharpening %s",
        [round(a, 4) for a in after[1.0]],
        {s: round(c, 3) for s, c in chains.items()},
    )
    policy.eagle.set_sharpening(sharpening)
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
        "prompts": opts.prompts,
        "threads": torch.get_num_threads(),
        "steps": steps,
        "lr": lr,
        "final_loss": round(loss, 4),
        "acceptance_before": round(before[0], 4),
        "acceptance_after": round(after[1.0][0], 4),
        "draft_steps_trained": draft_steps,
        "teacher_dtype": opts.sample_dtype,
        "step_decay": decay,
        "acceptance_before_by_step": [round(a, 4) for a in before],
        "acceptance_after_by_step": [round(a, 4) for a in after[1.0]],
        "chain_estimate_before": round(chain_estimate(before), 3),
        "chain_estimate_after": round(chains[1.0], 3),
        "draft_sharpening": sharpening,
        "acceptance_sharpened_by_step": [round(a, 4) for a in after[sharpening]],
        "chain_estimate_sharpened": round(chains[sharpening], 3),
        "chain_estimate_by_sharpening": {str(s): round(c, 3) for s, c in chains.items()},
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

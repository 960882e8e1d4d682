"""What the warm starts of the draft adapter (learner/prepare/draft_warmup.py) and the EAGLE-3
head (learner/prepare/eagle_warmup.py) share: their options, the policy's own completions of the
task's training prompts (sampled, split, with the draft vocabulary they use most), the training
loop and the summary."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from common.config import SpecRLConfig
from common.layers import KVCache
from common.model import Transformer, load_pretrained
from common.prompts import prompt_encoder
from common.sampling import processed_logprobs, sample_tokens
from common.tasks import PromptPool, task_from_config
from common.tokenizer import Tokenizer

log = logging.getLogger(__name__)


WARMUP_LR = 3e-3
"""AdamW rate of the warm-up unless ``--lr`` or ``spec.adapter_lr`` is given: on SmolLM2 it
reaches in 224 steps what 1e-3 (the RL run's ``spec.adapter_lr``) reaches in twice as many."""


class WarmDraftError(ValueError):
    """Input the warm-up refuses: a model the built-in Transformer cannot load, an exit layer or
    a vocabulary that does not fit the model, a bad flag."""


@dataclass
class WarmDraftOptions:
    """The command's flags (``specrl warm-draft -h``); the rest comes from the config."""

    prompts: int | None = None
    """Training prompts, the held-out ones included; None: 96 for the adapter, 1024 for the
    EAGLE-3 head (:func:`resolve_options`)."""
    samples_per_prompt: int = 2
    epochs: int | None = None
    """None: 6 for the adapter, 2 for the EAGLE-3 head."""
    threads: int = 0
    """``torch.set_num_threads`` for the command; 0: ``run.torch_threads`` for the adapter, and
    for the EAGLE-3 head the same when the command line sets it, else every core this process
    may run on."""
    batch: int = 4
    """Sequences per AdamW step."""
    holdout: float = 0.125
    """Share of the prompts whose completions only measure the acceptance (at least one)."""
    sample_batch: int = 32
    """Prompts decoded together (``samples_per_prompt`` rows each)."""
    sample_dtype: str = "bfloat16"
    """Of the sampling copy of the policy (``float32``: the policy itself, for a CPU without bf16
    instructions); the states the loss reads come from it. bf16 samples SmolLM2 1.5 times faster
    on an AVX-512 CPU core, and its states train an adapter as good (docs/training.md)."""
    sampler: str = "auto"
    """``auto``: vLLM for the EAGLE-3 head where vLLM serves the model, else the torch sampler;
    ``torch``; ``vllm`` (the head only) (``learner/prepare/vllm_sample.py``)."""
    device: str = "auto"
    exit_layer: int | None = None
    """None: ``spec.exit_layer`` unless it is the default, else :data:`EXIT_FRACTION`."""
    vocab: int | None = None
    """None: ``spec.adapter_vocab`` capped at the vocabulary (0 = the whole vocabulary)."""
    lr: float | None = None
    """None: :data:`WARMUP_LR`."""
    chunk: int = 256
    """Positions whose [chunk, V] logits the loss and the evaluation hold at a time."""
    out: Path | None = None
    """Write into a copy of the model directory here, not into the model directory."""
    summary: Path | None = None
    """The JSON summary; default ``<model dir or out>/draft_warmup.json``."""
    command: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Decoding:
    max_new_tokens: int
    exit_layer: int
    eos_id: int
    temperature: float
    top_p: float


@dataclass
class Sample:
    """One sampled completion and the frozen policy's states that the draft's loss reads."""

    prompt: list[int]
    completion: list[int]
    exit_states: Tensor
    """[P + C - 1, H] float32: the residual stream after ``exit_layer`` layers at positions
    0 .. P + C - 2 (what the draft attends to while it predicts the completion)."""
    full_states: Tensor
    """[C, H] float32: the final-normed hidden states at positions P - 1 .. P + C - 2 (each
    predicts the next completion token)."""


def load_policy(model_dir: Path, device: torch.device) -> Transformer:
    """The built-in Transformer of ``model_dir`` in float32, or a clear refusal."""
    try:
        return load_pretrained(model_dir, device, torch.float32).eval()
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise WarmDraftError(
            f"{model_dir}: the built-in Transformer cannot load this model ({e}); the draft "
            "adapter is part of common.model.Transformer (llama/qwen2/qwen3 safetensors)"
        ) from e


def resolve_vocab(
    cfg: SpecRLConfig, vocab_size: int, explicit: int | None, key: str = "adapter_vocab"
) -> int:
    """The draft vocabulary's size, 0 for the whole vocabulary: ``explicit`` (the user set
    ``spec.<key>``, ``spec.adapter_vocab`` by default; refused above the vocabulary), else
    ``spec.<key>`` capped at the vocabulary (the default 8192 exceeds a tiny model's whole
    vocabulary)."""
    if explicit is not None and explicit > vocab_size:
        raise WarmDraftError(
            f"spec.{key}={explicit} exceeds the model's vocabulary of {vocab_size} "
            "tokens (0 = the whole vocabulary)"
        )
    size = getattr(cfg.spec, key) if explicit is None else explicit
    return 0 if size >= vocab_size else size


DEFAULTS = {False: (96, 6), True: (1024, 2)}
"""(prompts, epochs) by default: the adapter's (False), the EAGLE-3 head's (True). The head has
an order of magnitude more to learn (a decoder layer, k draft steps); 4x the adapter's 96
prompts raised its step-1 acceptance 0.48 -> 0.68 on SmolLM2 (shared notes)."""


def resolve_options(opts: WarmDraftOptions, eagle: bool) -> WarmDraftOptions:
    """``opts`` with the defaults of the adapter's or (``eagle``) the head's warm start filled."""
    prompts, epochs = DEFAULTS[eagle]
    return replace(
        opts,
        prompts=prompts if opts.prompts is None else opts.prompts,
        epochs=epochs if opts.epochs is None else opts.epochs,
    )


def warm_threads(cfg: SpecRLConfig, opts: WarmDraftOptions) -> int:
    """The command's threads (``WarmDraftOptions.threads``)."""
    if opts.threads > 0:
        return opts.threads
    given = any(a.lstrip("+").startswith("run.torch_threads=") for a in opts.command[2:])
    if not cfg.spec.uses_eagle or given:
        return cfg.run.torch_threads
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_options(opts: WarmDraftOptions) -> None:
    least = {"prompts": 2, "samples_per_prompt": 1, "epochs": 0, "batch": 1, "sample_batch": 1}
    problems = [
        f"--{name.replace('_', '-')} must be >= {low}, got {getattr(opts, name)}"
        for name, low in least.items()
        if getattr(opts, name) < low
    ]
    if not 0.0 < opts.holdout < 1.0:
        problems.append(f"--holdout must be in (0, 1), got {opts.holdout}")
    if opts.sample_dtype not in ("float32", "bfloat16"):
        problems.append(f"--sample-dtype must be float32 or bfloat16, got {opts.sample_dtype!r}")
    if problems:
        raise WarmDraftError("; ".join(problems))


def training_prompts(
    cfg: SpecRLConfig, tokenizer: Tokenizer, n: int
) -> tuple[list[list[int]], int]:
    """(up to ``n`` distinct prompts of the task's training set, its pool when it has one;
    the task's ``max_new_tokens``)."""
    task = task_from_config(cfg.task)
    rng = random.Random(cfg.run.seed)
    if isinstance(task, PromptPool):
        problems = list(task.problems)
        rng.shuffle(problems)
    else:
        problems = task.sample(rng, 4 * n)
    texts = list(dict.fromkeys(p.prompt for p in problems))[:n]
    encode = prompt_encoder(
        tokenizer, cfg.task.chat_template, cfg.task.system_prompt, cfg.task.natural_language
    )
    return [encode(t) for t in texts], task.max_new_tokens


def turn_end_ids(tokenizer: Tokenizer) -> set[int]:
    """The ids a chat template puts after an assistant's reply (``<|im_end|>`` and a newline for
    SmolLM2): the draft must be able to propose the end of a turn."""
    hf = getattr(tokenizer, "_tokenizer", None)
    if hf is None or not getattr(hf, "chat_template", None):
        return set()
    messages = [{"role": "user", "content": "7"}, {"role": "assistant", "content": "42"}]
    try:
        ids = hf.apply_chat_template(messages, tokenize=True)
        ids = [int(i) for i in (ids if isinstance(ids, list) else ids["input_ids"])]
    except Exception as exc:  # noqa: BLE001 - a template that cannot render this adds no ids
        log.warning(
            "the chat template did not render a two-message chat (%s: %s): the draft will not "
            "be taught to propose the end of a turn, so acceptance there will be lower",
            type(exc).__name__,
            exc,
        )
        return set()
    reply = tokenizer.encode("42")
    for start in range(len(ids) - len(reply), -1, -1):
        if ids[start : start + len(reply)] == reply:
            return set(ids[start + len(reply) :])
    return set()


@torch.no_grad()
def sample_group(
    model: Transformer,
    prompts: Sequence[list[int]],
    n: int,
    decoding: Decoding,
    generator: torch.Generator,
    on_step: Callable[[int, int], None] | None = None,
) -> list[Sample]:
    """``n`` completions of each prompt (prompt-major), decoded together: one prefill of the
    right-padded prompts (the KV cache's semantics make the padding harmless), its cache copied
    to the ``n`` rows of each prompt, then a plain step per token, finished rows leaving the
    batch. ``on_step(step, live rows)`` after each step."""
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    exit_layer, max_new = decoding.exit_layer, decoding.max_new_tokens
    lens = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.zeros((len(prompts), int(lens.max())), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, device=device)
    cache = KVCache(model.args, len(prompts), ids.shape[1] + max_new, device, dtype)

    def forward(tokens: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        h_exit = model.run_layers(model.model.embed_tokens(tokens), pos, cache, 0, exit_layer)
        h = model.run_layers(h_exit, pos, cache, exit_layer, model.args.num_hidden_layers)
        return h_exit, model.model.norm(h)

    prompt_exit, full = forward(ids, torch.arange(ids.shape[1], device=device).expand_as(ids))
    rows = torch.arange(len(prompts), device=device).repeat_interleave(n)  # each row's prompt
    cache.select_rows(rows)
    last = full[rows, lens[rows] - 1]  # [R, H]: predicts each row's first token
    exits = torch.zeros((len(rows), max_new, model.args.hidden_size), device=device, dtype=dtype)
    fulls = torch.zeros_like(exits)
    fulls[:, 0] = last
    tokens = torch.zeros((len(rows), max_new), dtype=torch.long, device=device)
    lengths = torch.zeros(len(rows), dtype=torch.long, device=device)
    alive = torch.arange(len(rows), device=device)  # the rows still decoding
    pos = lens[rows].clone()  # the position of each live row's next token
    for step in range(max_new):
        logprobs = processed_logprobs(
            model.lm_head(last).float(), decoding.temperature, decoding.top_p
        )
        token, _ = sample_tokens(logprobs, generator)
        tokens[alive, step], lengths[alive] = token, step + 1
        keep = (token != decoding.eos_id).nonzero().squeeze(-1)
        if on_step is not None:
            on_step(step, alive.numel())
        if step + 1 == max_new or keep.numel() == 0:
            break
        if keep.numel() < alive.numel():
            cache.select_rows(keep)
            alive, pos, token = alive[keep], pos[keep], token[keep]
        h_exit, full = forward(token[:, None], pos[:, None])
        exits[alive, step], fulls[alive, step + 1] = h_exit[:, 0], full[:, 0]
        last, pos = full[:, 0], pos + 1
    out = []
    for r, (p, c) in enumerate(zip(rows.tolist(), lengths.tolist(), strict=True)):
        states = torch.cat([prompt_exit[p, : len(prompts[p])], exits[r, : c - 1]])
        completion = tokens[r, :c].tolist()
        out.append(
            Sample(list(prompts[p]), completion, states.float().cpu(), fulls[r, :c].float().cpu())
        )
    return out


def sample_all(
    model: Transformer,
    prompts: list[list[int]],
    opts: WarmDraftOptions,
    decoding: Decoding,
    seed: int,
) -> list[list[Sample]]:
    """Per prompt, its ``samples_per_prompt`` completions; prompts of similar length decode
    together; progress lines (prompts done/total, tokens, tokens/s, ETA) every 32 steps."""
    generator = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[list[Sample]] = [[] for _ in prompts]
    started, done, tokens = time.perf_counter(), 0, 0

    def report(step: int, live: int) -> None:
        nonlocal tokens
        tokens += live
        if (step + 1) % 32:
            return
        elapsed = time.perf_counter() - started
        share = (done + len(chunk) * (step + 1) / decoding.max_new_tokens) / len(prompts)
        log.info(
            f"sampling: {done}/{len(prompts)} prompts done, step {step + 1}/"
            f"{decoding.max_new_tokens} of the next {len(chunk)}, {tokens} tokens, "
            f"{tokens / elapsed:.0f} tokens/s, elapsed {elapsed:.0f}s, "
            f"ETA {elapsed / share * (1 - share):.0f}s"
        )

    for start in range(0, len(order), opts.sample_batch):
        chunk = order[start : start + opts.sample_batch]
        group = [prompts[i] for i in chunk]
        samples = sample_group(model, group, opts.samples_per_prompt, decoding, generator, report)
        for j, sample in enumerate(samples):
            results[chunk[j // opts.samples_per_prompt]].append(sample)
        done += len(chunk)
        elapsed = time.perf_counter() - started
        log.info(
            f"sampling: {done}/{len(prompts)} prompts, {tokens} tokens, "
            f"{tokens / elapsed:.0f} tokens/s, elapsed {elapsed:.0f}s, "
            f"ETA {elapsed / done * (len(prompts) - done):.0f}s"
        )
    return results


def draft_vocabulary(
    completions: Sequence[Sequence[int]],
    prompts: Sequence[Sequence[int]],
    size: int,
    vocab_size: int,
    keep: set[int],
) -> Tensor | None:
    """``size`` sorted token ids: ``keep`` (end-of-turn ids), then the completions' most
    frequent tokens, then the prompts', then the lowest ids; None for ``size`` 0 (the whole
    vocabulary)."""
    if size == 0:
        return None
    chosen = dict.fromkeys(sorted(i for i in keep if 0 <= i < vocab_size))
    for source in (completions, prompts, [range(vocab_size)]):
        for token, _ in Counter(t for seq in source for t in seq).most_common():
            if len(chosen) >= size:
                break
            chosen.setdefault(token)
    return torch.tensor(sorted(chosen)[:size], dtype=torch.long)


def coverage(ids: Tensor | None, completions: Sequence[Sequence[int]]) -> float:
    """Share of the tokens of ``completions`` inside the draft vocabulary ``ids``."""
    total = sum(len(c) for c in completions)
    if ids is None or total == 0:
        return 1.0
    inside = set(ids.tolist())
    return sum(t in inside for c in completions for t in c) / total


def tokens_per_verify(acceptance: float, k: int) -> float:
    """Expected tokens per verification of a k-token chain whose tokens are each accepted with
    probability a: (1 - a^(k+1)) / (1 - a), k + 1 when a = 1."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def train_draft(
    policy: Transformer,
    draft: torch.nn.Module,
    samples: list,
    opts: WarmDraftOptions,
    lr: float,
    seed: int,
    batch_loss: Callable[[list], Tensor],
) -> tuple[int, float]:
    """AdamW on ``draft``'s parameters only (the rest of ``policy`` frozen), ``opts.epochs``
    shuffled passes over ``samples`` in batches of ``opts.batch``, each step's loss
    ``batch_loss(batch)``, a linear warm-up over 5% of the steps then a cosine decay to a tenth;
    returns (steps, mean loss of the last epoch)."""
    policy.requires_grad_(False)
    params = list(draft.parameters())
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps = opts.epochs * math.ceil(len(samples) / opts.batch)
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    rng = random.Random(seed)
    started, step, losses = time.perf_counter(), 0, [float("nan")]
    for epoch in range(opts.epochs):
        order, losses = list(samples), []
        rng.shuffle(order)
        for i in range(0, len(order), opts.batch):
            loss = batch_loss(order[i : i + opts.batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            losses.append(loss.item())
            if step % max(1, steps // 20) == 0 or step == steps:
                elapsed = time.perf_counter() - started
                log.info(
                    "training: step %d/%d (epoch %d/%d), loss %.4f, elapsed %.0fs, ETA %.0fs",
                    *(step, steps, epoch + 1, opts.epochs, losses[-1], elapsed),
                    elapsed / step * (steps - step),
                )
    policy.requires_grad_(False)
    return steps, sum(losses) / max(len(losses), 1)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """``torch.set_num_threads(n)`` for the block (``run.torch_threads``: on a CPU shared with
    other processes, more threads than free cores make every matmul wait for a descheduled one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def sampling_copy(policy: Transformer, dtype: str) -> Transformer:
    """The model that samples: the policy itself in float32, or a bf16 copy of it."""
    return copy.deepcopy(policy).to(torch.bfloat16) if dtype == "bfloat16" else policy


@dataclass
class Sampled:
    """The warm start's data: the policy's own completions of the task's training prompts,
    split by prompt, and the draft vocabulary the training ones use most."""

    train: list[Sample]
    evaluation: list[Sample]
    """Completions of the held-out prompts: they only measure the acceptance."""
    vocab_ids: Tensor | None
    coverage: float
    """Share of the held-out completion tokens inside ``vocab_ids``."""
    seconds: float
    sampler: str = "torch"


SAMPLERS = ("auto", "torch", "vllm")


def resolve_sampler(sampler: str, eagle: bool, model_dir: Path) -> str:
    """``torch`` or ``vllm`` for ``--sampler``: ``auto`` takes vLLM for the EAGLE-3 head when it
    can (:func:`why_not_vllm`), else torch; ``vllm`` is refused for the adapter (it reads the
    sampler's states) or when vLLM cannot serve the model."""
    from learner.prepare.vllm_sample import why_not_vllm

    if sampler not in SAMPLERS:
        raise WarmDraftError(f"--sampler must be one of {SAMPLERS}, got {sampler!r}")
    if sampler == "torch" or (sampler == "auto" and not eagle):
        return "torch"
    if not eagle:
        raise WarmDraftError(
            "--sampler vllm samples for the EAGLE-3 head only (spec=eagle3): the draft "
            "adapter's warm start trains on the torch sampler's own states"
        )
    why = why_not_vllm(model_dir)
    if why is None:
        return "vllm"
    if sampler == "vllm":
        raise WarmDraftError(f"--sampler vllm: {why}")
    log.info("sampling with the torch sampler: %s", why)
    return "torch"


def sample_for_warmup(
    cfg: SpecRLConfig,
    opts: WarmDraftOptions,
    policy: Transformer,
    tokenizer,
    exit_layer: int,
    vocab: int,
    model_dir: Path,
) -> Sampled:
    """Sample ``opts.samples_per_prompt`` completions of ``opts.prompts`` training prompts at
    the run's sampling settings (plain decoding, recording the states after ``exit_layer``;
    with vLLM, ``opts.sampler``, the tokens only), hold a share of the prompts out and pick the
    ``vocab`` tokens the rest use most (0: all)."""
    started = time.perf_counter()
    sampler = resolve_sampler(opts.sampler, cfg.spec.uses_eagle, model_dir)
    prompts, max_new = training_prompts(cfg, tokenizer, opts.prompts)
    held = max(1, round(len(prompts) * opts.holdout))
    if len(prompts) <= held:
        raise WarmDraftError(f"{len(prompts)} distinct prompts: too few to hold {held} out")
    log.info(
        "sampling %d prompts (%d held out) x %d completions with the %s sampler",
        len(prompts),
        held,
        opts.samples_per_prompt,
        sampler,
    )
    sampling = cfg.sampling
    decoding = Decoding(max_new, exit_layer, tokenizer.eos_id, sampling.temperature, sampling.top_p)
    if sampler == "vllm":
        groups = _vllm_groups(model_dir, prompts, opts, decoding, cfg.run.seed)
    else:
        groups = sample_all(
            sampling_copy(policy, opts.sample_dtype), prompts, opts, decoding, cfg.run.seed
        )
    evaluation = [s for g in groups[:held] for s in g]
    train = [s for g in groups[held:] for s in g]
    keep = {tokenizer.eos_id, tokenizer.bos_id, tokenizer.pad_id} | turn_end_ids(tokenizer)
    completions = [s.completion for s in train]
    ids = draft_vocabulary(completions, prompts[held:], vocab, policy.args.vocab_size, keep)
    covered = coverage(ids, [s.completion for s in evaluation])
    return Sampled(train, evaluation, ids, covered, time.perf_counter() - started, sampler)


def _vllm_groups(
    model_dir: Path, prompts: list[list[int]], opts: WarmDraftOptions, decoding: Decoding, seed: int
) -> list[list[Sample]]:
    """vLLM's completions as samples without states (the head's records recompute them)."""
    from learner.prepare.vllm_sample import sample_vllm

    none = torch.empty(0)
    groups = sample_vllm(
        model_dir, prompts, opts.samples_per_prompt, decoding, seed, opts.sample_dtype
    )
    return [[Sample(p, c, none, none) for p, c in group] for group in groups]


def save_into(
    policy: Transformer,
    model_dir: Path,
    out: Path | None,
    save: Callable[[Transformer, Path], None],
) -> Path:
    """``save(policy, dir)`` (the adapter's or the head's) into ``model_dir``, or into ``out``,
    made a copy of it first; returns the directory written."""
    target = model_dir if out is None else out
    if not target.exists() or not target.samefile(model_dir):
        shutil.copytree(model_dir, target, dirs_exist_ok=True)
    save(policy, target)
    return target


def write_summary(
    cfg: SpecRLConfig,
    opts: WarmDraftOptions,
    sampled: Sampled,
    own: dict,
    trained: dict,
    default_file: Path,
    started: float,
) -> dict:
    """The warm start's summary: ``own`` (the draft's own fields), the data's, ``trained`` (steps,
    lr, final_loss, acceptance_before, acceptance_after, and any more) and the timings; written
    as JSON to ``opts.summary`` or ``default_file``, returned with its path."""
    k = cfg.spec.k
    summary = {
        **own,
        "heldout_coverage": round(sampled.coverage, 4),
        "train_samples": len(sampled.train),
        "heldout_samples": len(sampled.evaluation),
        "train_tokens": sum(len(s.completion) for s in sampled.train),
        "heldout_tokens": sum(len(s.completion) for s in sampled.evaluation),
        "epochs": opts.epochs,
        "sampler": sampled.sampler,
        **trained,
        "k": k,
        "tokens_per_verify_before": round(tokens_per_verify(trained["acceptance_before"], k), 3),
        "tokens_per_verify_after": round(tokens_per_verify(trained["acceptance_after"], k), 3),
        "sample_seconds": round(sampled.seconds, 1),
        "train_seconds": round(time.perf_counter() - started - sampled.seconds, 1),
        "seconds": round(time.perf_counter() - started, 1),
        "command": " ".join(opts.command),
    }
    path = opts.summary or default_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return {**summary, "summary_file": str(path)}

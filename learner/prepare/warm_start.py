"""``specrl init-model``: the tiny built-in model, warm-started by a short supervised phase.

RL post-training starts from a model that is partly competent (a pretrained/SFT base); a random
model would get zero reward everywhere and GRPO would have no signal. The warm start trains on
task demonstrations for ``model.init_steps`` steps — deliberately too few for mastery — and the
RL run takes it from there. Deterministic for a seed.

The learner builds its starting model through :func:`ensure_model` when it is given none; the
operator's ``specrl init-model`` and launcher build it ahead of the run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common.config import SpecRLConfig
from common.layers import KVCache
from common.model import Transformer, save_pretrained
from common.model_args import ModelArgs
from common.model_presets import MODELS_DIR
from common.sampling import processed_logprobs
from common.tasks import Problem, Task, task_from_config
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer, Tokenizer, encode_prompt
from learner.prepare.presets import ensure_preset

log = logging.getLogger(__name__)


def default_model_dir(cfg: SpecRLConfig) -> Path:
    """Where the built-in model for this task/size/seed lives; the name encodes what built it."""
    m, t = cfg.model, cfg.task
    name = (
        f"{t.name}-d{t.min_digits}-{t.max_digits}-h{m.hidden_size}-l{m.num_layers}"
        f"-a{m.num_heads}-kv{m.num_kv_heads}-i{m.intermediate_size}"
        f"-s{m.init_steps}-b{m.init_batch_size}-lr{m.init_lr:g}"
        + (f"-e{m.init_exit_layer}" if m.init_exit_layer else "")
        + f"-seed{cfg.run.seed}"
    )
    return MODELS_DIR / name


def ensure_model(
    cfg: SpecRLConfig, progress: Callable[[int, int, float], None] | None = None
) -> Path:
    """The model directory to train: a preset's (built once), ``model.path`` if given, else the
    built-in one (built once)."""
    if cfg.model.preset:
        return ensure_preset(cfg.model.preset, Path(cfg.model.path))
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path={cfg.model.path!r} has no config.json")
        return path
    path = default_model_dir(cfg)
    if not (path / "config.json").is_file():
        warm_start(cfg, path, progress)
    return path


def tiny_model_args(cfg: SpecRLConfig, tokenizer: Tokenizer, task: Task) -> ModelArgs:
    m = cfg.model
    return ModelArgs(
        vocab_size=tokenizer.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        # Room for the longest prompt and completion, in steps of 64 (128 for the short tasks).
        max_position_embeddings=max(128, 64 * math.ceil((task.max_new_tokens + 32) / 64)),
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )


def supervised_batch(
    task: Task, tokenizer: Tokenizer, rng: random.Random, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``BOS prompt demonstration EOS``; loss mask [B, S-1] on the completion only. A
    multi-turn task's demonstration is segments (``demonstration_segments``: the model's turns,
    each followed by EOS, and the environment's spans, masked)."""
    rows = []
    segmented = hasattr(task, "demonstration_segments")
    for problem in task.sample(rng, n):
        prompt = encode_prompt(tokenizer, problem.prompt)
        if segmented:
            completion, trained = [], []
            for text, model_turn in task.demonstration_segments(problem, rng):
                ids = [*tokenizer.encode(text), *([tokenizer.eos_id] if model_turn else [])]
                completion += ids
                trained += [float(model_turn)] * len(ids)
        else:
            # The wording of a worked answer is drawn with rng (tasks with one way ignore it).
            completion = [*tokenizer.encode(task.demonstration(problem, rng)), tokenizer.eos_id]
            trained = [1.0] * len(completion)
        rows.append((prompt, completion, trained))
    seq_len = max(len(p) + len(c) for p, c, _ in rows)
    ids = torch.full((n, seq_len), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((n, seq_len - 1))
    for i, (p, c, t) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) - 1 : len(p) + len(c) - 1] = torch.tensor(t)
    return ids, mask


def supervised_loss(
    model: Transformer, ids: torch.Tensor, mask: torch.Tensor, exit_layer: int = 0
) -> torch.Tensor:
    """Mean completion-token cross-entropy of the full model on ``ids`` [B, S] (mask [B, S-1]);
    with ``exit_layer`` > 0 plus half the same loss on the early exit's logits (LayerSkip)."""
    layers = model.args.num_hidden_layers
    x = model.model.embed_tokens(ids)  # [B, S, H]
    if exit_layer:
        h_exit = model.run_layers(x, None, None, 0, exit_layer)
        heads = [(1.0, model.run_layers(h_exit, None, None, exit_layer, layers)), (0.5, h_exit)]
    else:
        heads = [(1.0, model.run_layers(x, None, None, 0, layers))]
    loss = torch.zeros(())
    for weight, hidden in heads:
        logits = model.head(hidden)[:, :-1]  # [B, S-1, V]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        ).view_as(mask)
        loss = loss + weight * (nll * mask).sum() / mask.sum()
    return loss


@torch.no_grad()
def sampled_accuracy(
    model: Transformer, task: Task, tokenizer: Tokenizer, n: int = 256, seed: int = 12345
) -> float:
    """Mean reward of one temperature-1 sample per problem (what RL starts from).

    Problems with prompts of equal length decode together with a KV cache, so a task with long
    answers decodes in a few batched passes rather than one problem at a time."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    problems = task.sample(random.Random(seed), n)
    by_length: dict[int, list[tuple[Problem, list[int]]]] = {}
    for problem in problems:
        prompt = encode_prompt(tokenizer, problem.prompt)
        by_length.setdefault(len(prompt), []).append((problem, prompt))
    rewards = []
    for length, group in sorted(by_length.items()):
        ids = torch.tensor([prompt for _, prompt in group])  # [B, P]
        cache = KVCache(model.args, len(group), length + task.max_new_tokens)
        logits = model(ids, torch.arange(length).expand(len(group), -1), cache)[:, -1]
        out = torch.empty((len(group), 0), dtype=torch.long)
        for step in range(task.max_new_tokens):
            token = torch.multinomial(processed_logprobs(logits, 1.0).exp(), 1, generator=gen)
            out = torch.cat([out, token], dim=1)  # [B, step + 1]
            if bool((out == tokenizer.eos_id).any(dim=1).all()):
                break
            position = torch.full((len(group), 1), length + step)
            logits = model(token, position, cache)[:, -1]
        for (problem, _), row in zip(group, out.tolist(), strict=True):
            completion = row[: row.index(tokenizer.eos_id)] if tokenizer.eos_id in row else row
            rewards.append(task.reward(problem, tokenizer.decode(completion)))
    model.train(was_training)
    return sum(rewards) / len(rewards)


def warm_start(
    cfg: SpecRLConfig, out_dir: Path, progress: Callable[[int, int, float], None] | None = None
) -> dict[str, float]:
    """Build, train briefly and save the tiny model for ``cfg.task``; returns summary figures."""
    if cfg.task.is_dataset:
        raise ValueError(
            "init-model builds the tiny model of a built-in task; for a data set set model.path"
        )
    torch.manual_seed(cfg.run.seed)
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    # The warm start stands in for pre-training: the whole task distribution, not the RL pool.
    task = task_from_config(dataclasses.replace(cfg.task, pool_size=0))
    args = tiny_model_args(cfg, tokenizer, task)
    model = Transformer(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.model.init_lr, weight_decay=0.0)
    rng = random.Random(cfg.run.seed)
    started = time.perf_counter()
    loss_value = float("nan")
    model.train()
    for step in range(cfg.model.init_steps):
        ids, mask = supervised_batch(task, tokenizer, rng, cfg.model.init_batch_size)
        loss = supervised_loss(model, ids, mask, cfg.model.init_exit_layer)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
        if progress is not None:
            progress(step + 1, cfg.model.init_steps, loss_value)
    accuracy = sampled_accuracy(model, task, tokenizer)
    # Written beside the target and renamed, so a killed init never leaves a half model behind.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    save_pretrained(model, tmp)
    tokenizer.save(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    summary = {
        "init/steps": cfg.model.init_steps,
        "init/final_loss": loss_value,
        "init/sampled_reward": accuracy,
        "init/seconds": time.perf_counter() - started,
    }
    log.info("init-model: %s -> %s", summary, out_dir)
    return summary

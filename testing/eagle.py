"""EAGLE-3 heads for the torch engine's tests: a fresh (random) head, or one fitted to its policy
so that its drafts are accepted (tests/unit/actors/test_eagle_drafting.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from common.eagle import attach_eagle
from common.model import Transformer


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside: a tiny model's many small ops run several times faster than
    on two threads of a CPU that other processes share."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def with_head(model: Transformer, vocab: Sequence[int] | None = None, seed: int = 0) -> Transformer:
    """``model`` with a fresh EAGLE-3 head at vLLM's default inputs, drafting over the token ids
    ``vocab`` (None: all); returns ``model``."""
    attach_eagle(model, vocab_ids=None if vocab is None else torch.tensor(vocab), seed=seed)
    return model.eval()


def fit_head(
    model: Transformer,
    steps: int = 150,
    batch: int = 32,
    length: int = 10,
    lr: float = 3e-3,
    temperature: float = 1.0,
    seed: int = 0,
) -> float:
    """Train ``model.eagle`` in place (Adam, its parameters only) towards the policy: the head at
    position t (the policy's auxiliary states at t, the token at t + 1) against the policy's
    distribution at t + 1, at ``temperature``, over the head's vocabulary (cross-entropy from p),
    on uniformly random token sequences (every context of a tiny vocabulary shows up). Returns
    the last step's mean KL(p || q) over the head's vocabulary, p renormalised on it."""
    head = model.eagle
    assert head is not None, "attach a head first (with_head)"
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    with one_thread():
        kl = _fit(model, steps, batch, length, temperature, generator, optimizer)
    for param in model.parameters():
        param.grad = None
    return kl


def _fit(
    model: Transformer,
    steps: int,
    batch: int,
    length: int,
    temperature: float,
    generator: torch.Generator,
    optimizer: torch.optim.Optimizer,
) -> float:
    head = model.eagle
    vocab_ids = head.vocab_ids
    layers = model.args.num_hidden_layers
    kl = float("nan")
    for _ in range(steps):
        ids = torch.randint(0, model.args.vocab_size, (batch, length), generator=generator)
        with torch.no_grad():
            aux: list[torch.Tensor] = []
            h = model.run_layers(model.model.embed_tokens(ids), None, None, 0, layers, aux=aux)
            p = F.softmax(model.head(h)[:, 1:, vocab_ids] / temperature, dim=-1)  # [B, T-1, V_d]
            states = torch.cat(aux, dim=-1)[:, :-1]
            embeds_ids = ids[:, 1:]
        with torch.enable_grad():
            out = model.run_eagle(embeds_ids, head.combine(states), None, None)
            log_q = F.log_softmax(head.logits(out) / temperature, dim=-1)
            loss = -(p * log_q).sum(-1).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        kl = float(loss.detach() + (p * p.clamp_min(1e-30).log()).sum(-1).mean())
    return kl

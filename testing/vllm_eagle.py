"""Helpers for the EAGLE-3 tests of the vLLM tier: a random EAGLE-3 head in vLLM's checkpoint
names (``eagle.*``, as a published version carries it) for a specrl model, and a model directory
holding both; the enumerable set-up of the head's lossless check on vLLM, which
tests/engine_vllm/test_vllm_eagle.py and benchmarks/engines_eagle.py share."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.eagle import EAGLE_FILE, EAGLE_PREFIX, attach_eagle
from common.model import Transformer, save_pretrained
from testing.lossless_check import NO_EOS, exact_sequence_logprobs, peaky_model, rollouts_pvalue

HEAD_FILE = EAGLE_FILE
"""Where the head's tensors live in a model directory (a subdirectory: vLLM loads the target
from the top-level ``*.safetensors`` only)."""


def with_head(
    model: Transformer, aux: Sequence[int], vocab_ids: Sequence[int] | None, seed: int
) -> Transformer:
    """``model`` with an EAGLE-3 head (``Transformer.eagle``, :func:`common.eagle.attach_eagle`)
    reading the residual stream after ``aux`` layers, over the token ids ``vocab_ids`` (None:
    the whole vocabulary), its weights :func:`random_head`'s: loaded by the names a published
    version carries, which are vLLM's checkpoint names."""
    ids = None if vocab_ids is None else torch.tensor(list(vocab_ids))
    attach_eagle(model, tuple(aux), ids, seed)
    head = random_head(model, vocab_ids, seed)
    head.setdefault(EAGLE_PREFIX + "d2t", torch.zeros(model.args.vocab_size, dtype=torch.long))
    n = len(EAGLE_PREFIX)
    model.eagle.load_state_dict({k[n:]: v for k, v in head.items()}, strict=True)
    return model


def random_head(
    model: Transformer, vocab_ids: Sequence[int] | None, seed: int, std: float = 0.3
) -> dict[str, torch.Tensor]:
    """A random EAGLE-3 head for ``model`` (whose args carry ``eagle_aux_layers``), as
    ``eagle.*`` tensors: matrices from N(0, std / sqrt(fan-in)) after ``seed``, unit norms, the
    LM head the model's own rows of ``vocab_ids`` (so drafts are near the model's and some are
    accepted) plus noise, ``d2t`` the offsets of ``vocab_ids``."""
    a = model.args
    h, heads, kv = a.hidden_size, a.num_attention_heads, a.num_key_value_heads
    d = a.head_dim or h // heads
    n_aux = len(a.eagle_aux_layers)
    g = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * std / cols**0.5

    ids = torch.arange(a.vocab_size) if vocab_ids is None else torch.tensor(list(vocab_ids))
    lm_head = model.lm_head.weight.detach()[ids].float()
    lm_head = lm_head + lm_head.std() * 0.5 * torch.randn(lm_head.shape, generator=g)
    head = {
        "fc.weight": mat(h, n_aux * h),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": mat(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": mat(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": mat(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": mat(h, heads * d),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.mlp.gate_proj.weight": mat(a.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": mat(a.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": mat(h, a.intermediate_size),
        "norm.weight": torch.ones(h),
        "lm_head.weight": lm_head.contiguous(),
    }
    if vocab_ids is not None:
        head["d2t"] = (ids - torch.arange(len(ids))).to(torch.int64)
    return {EAGLE_PREFIX + k: v for k, v in head.items()}


def head_of(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's head as a published version carries it (``eagle.*``)."""
    return {
        k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith(EAGLE_PREFIX)
    }


def save_with_head(model: Transformer, head: dict[str, torch.Tensor], path: Path) -> Path:
    """``model`` (``config.json`` naming its head, if any) with ``head`` in :data:`HEAD_FILE`
    in place of its own (no file when empty)."""
    path = Path(path)
    save_pretrained(model, path)
    (path / HEAD_FILE).unlink(missing_ok=True)
    if head:
        (path / HEAD_FILE).parent.mkdir(exist_ok=True)
        save_file({k: v.contiguous() for k, v in head.items()}, str(path / HEAD_FILE))
    return path


def published(model: Transformer) -> dict[str, torch.Tensor]:
    """A published version of ``model``: its tensors, the head's (``eagle.*``) included."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ the enumerable lossless check

PROMPT, NEW = [1, 4, 5, 4], 3
"""The prompt and the completions' length (vocabulary 6: every completion can be enumerated)."""
AUX, VOCAB_IDS, K = (1, 2, 3), (0, 2, 3, 4, 5), 2
"""The head reads the residual stream after layers 1, 2 and 3, drafts over 5 of the 6 tokens
(``d2t``), K tokens a step."""


def enumerable_policy(seed: int) -> Transformer:
    """An enumerable peaky model with a random EAGLE-3 head (``eagle.*`` tensors)."""
    return with_head(peaky_model(6, seed, 6.0), AUX, VOCAB_IDS, seed=seed + 10)


def published_engine(model: Transformer, path: Path, spec, seed: int = 5):
    """A sampling vLLM engine (``testing.vllm.enumerable_vllm``) started as an actor starts it:
    from the directory it writes at ``path`` of ``model`` published as version 0."""
    from actors.wiring import write_published
    from common.policy_meta import policy_meta
    from common.tokenizer import CharTokenizer
    from testing.vllm import enumerable_vllm

    write_published(policy_meta(model.args, CharTokenizer("abc")), published(model), path)
    return enumerable_vllm(path, spec, seed, version=0)


def sample(engine, n: int, temperature: float = 1.0, top_p: float = 1.0) -> list:
    """Completions of PROMPT at ``temperature`` and ``top_p``, 300 a call: ``n`` rounded down to
    a multiple of 300 (at least one call)."""
    engine.temperature, engine.top_p = temperature, top_p  # read per request
    out = []
    for _ in range(max(1, n // 300)):
        out += engine.generate([PROMPT], 300, NEW)[0]
    return out


def pvalue(model: Transformer, out, temperature: float = 1.0, top_p: float = 1.0) -> float:
    """Chi-square p of the completions ``out`` against ``model``'s exact law at ``temperature``
    and ``top_p``; 0 when one lies outside it (a negative control)."""
    law = exact_sequence_logprobs(model, PROMPT, NEW, temperature, top_p, NO_EOS)
    try:
        return rollouts_pvalue(law, out)
    except KeyError:
        return 0.0


@contextmanager
def rotated_draft_q(engine) -> Iterator[None]:
    """The negative control of the head's lossless check: inside, vLLM's rejection sampler reads
    the head's q with its token ids rotated by one while the drafts are still drawn from the true
    q; the drafter restored after."""
    drafter = engine.llm.collective_rpc(lambda worker: worker.model_runner.drafter)[0]
    take = drafter.take_last_draft_probs

    def rotated():
        q = take()
        return None if q is None else q.roll(1, dims=-1).contiguous()

    drafter.take_last_draft_probs = rotated
    try:
        yield
    finally:
        del drafter.take_last_draft_probs  # the class's method again

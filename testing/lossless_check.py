"""Statistical check that an engine samples complete sequences from the plain sampling distribution.

Used by the tests and by ``benchmarks/rollout.py`` (whose ``lossless`` figure must come from the
same run as its speeds). On a tiny vocabulary every possible output of ``max_new`` tokens can be
enumerated and its exact probability computed with plain forward passes; the engine's samples are
then compared with a chi-square goodness-of-fit test.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from actors.engines.rollout_engine import Rollout
from actors.engines.torch.engine import TorchEngine
from common import metric_names as mn
from common.config.actor import SpecConfig
from common.model import Transformer, attach_draft
from common.sampling import processed_logprobs
from testing.goodness_of_fit import chi_square_pvalue
from testing.models import random_model, token_logprobs

EOS = 2
"""The EOS id of the engines in :func:`greedy_matches_plain` and :func:`sampled_pvalue`."""
NO_EOS = 99
"""An EOS id outside an enumerable model's vocabulary: every completion runs to its length."""


def peaky_model(vocab: int, seed: int, scale: float, layers: int = 3) -> Transformer:
    """A random model whose next-token distributions are far from uniform (and far from its own
    early exit and from another seed's), so a wrong sampling rule shows in the statistics."""
    model = random_model(vocab, seed, num_hidden_layers=layers)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        model.model.embed_tokens.weight.mul_(scale / 2)
    return model


def perturbed_pair(vocab: int) -> tuple[Transformer, Transformer]:
    """A peaky model and a copy with its LM head perturbed (0.5 std, seed 5): close enough that
    about two thirds of the tokens in flight at a swap are kept, so delayed verification runs
    both its acceptance and its residual."""
    old = peaky_model(vocab, 1, 6.0)
    new = copy.deepcopy(old)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        weight = new.lm_head.weight
        weight.add_(0.5 * weight.std() * torch.randn(weight.shape, generator=generator))
    return old, new


@torch.no_grad()
def exact_sequence_logprobs(
    model: Transformer,
    prompt: Sequence[int],
    max_new: int,
    temperature: float,
    top_p: float,
    eos_id: int,
) -> dict[tuple[int, ...], float]:
    """log P(output) of every possible complete output (ends in EOS or has ``max_new`` tokens)."""
    vocab = model.args.vocab_size
    outcomes: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], logp: float) -> None:
        seq = torch.tensor([[*prompt, *prefix]])
        lp = processed_logprobs(model(seq)[0, -1], temperature, top_p)
        for token in range(vocab):
            if lp[token] == float("-inf"):
                continue
            out = (*prefix, token)
            total = logp + float(lp[token])
            if token == eos_id or len(out) == max_new:
                outcomes[out] = total
            else:
                walk(out, total)

    walk((), 0.0)
    return outcomes


def outcome_counts(
    exact: Mapping[tuple[int, ...], float], rollouts: Iterable[Rollout]
) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each complete output of ``exact`` (``exact_sequence_logprobs``) occurs among
    ``rollouts``, and its exact probability, both in ``sorted(exact)`` order; an output outside
    ``exact`` raises ``KeyError`` (the engine produced something impossible)."""
    keys = sorted(exact)
    index = {k: i for i, k in enumerate(keys)}
    counts = torch.zeros(len(keys), dtype=torch.float64)
    for rollout in rollouts:
        counts[index[tuple(rollout.token_ids.tolist())]] += 1
    probs = torch.tensor([exact[k] for k in keys], dtype=torch.float64).exp()
    return counts, probs


def rollouts_pvalue(exact: Mapping[tuple[int, ...], float], rollouts: Iterable[Rollout]) -> float:
    """Chi-square p-value of ``rollouts`` against the exact distribution ``exact``: the one
    enumerate / sample / chi-square check every lossless test and benchmark runs."""
    return chi_square_pvalue(*outcome_counts(exact, rollouts))


def sequence_pvalue(
    engine: TorchEngine, prompt: Sequence[int], max_new: int, samples: int, calls: int = 2
) -> float:
    """Chi-square p-value of ``samples`` engine outputs against the exact plain distribution.

    The samples come from ``calls`` generate calls, so history drafters also draft from earlier
    completions of the prompt.
    """
    exact = exact_sequence_logprobs(
        engine.model, prompt, max_new, engine.temperature, engine.top_p, engine.eos_id
    )
    rollouts = [
        r
        for _ in range(calls)
        for r in engine.generate([list(prompt)], samples // calls, max_new)[0]
    ]
    return rollouts_pvalue(exact, rollouts)


def with_adapter(model: Transformer, spec: SpecConfig, vocab: Sequence[int] | None) -> Transformer:
    """``model`` with a draft adapter after ``spec.exit_layer`` when ``spec.adapter`` (over the
    token ids ``vocab``, None = all), its weights perturbed so that its drafts differ from the
    model's own distributions (rejections happen); ``model`` as it is otherwise."""
    if spec.adapter:
        attach_draft(model, spec.exit_layer, None if vocab is None else torch.tensor(vocab))
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.draft.layer.parameters():
                p.add_(0.3 * p.std(unbiased=False) * torch.randn(p.shape, generator=generator))
    return model


ADAPTER_VOCAB = (0, 2, 3, 4, 5)
"""The draft vocabulary of the adapter in the checks below: EOS included, token 1 left out."""


def greedy_matches_plain(spec: SpecConfig) -> tuple[dict[str, float], int]:
    """Greedy decoding with ``spec`` gives plain greedy decoding's outputs, token for token, on
    two calls in a row (the second also drafts from earlier completions of the same prompts).
    Returns the speculative engine's stats and the tokens of its last call."""
    model = with_adapter(peaky_model(vocab=16, seed=0, scale=30.0), spec, None)
    prompts = [[1, 5, 6, 5, 6], [1, 7], [1, 8, 9, 8, 9, 8, 9], [1, 3]]
    plain = TorchEngine(model, EOS, 0, temperature=0.0).generate(prompts, 2, 12)
    engine = TorchEngine(model, EOS, 0, temperature=0.0, spec=spec)
    for _ in range(2):
        fast = engine.generate(prompts, 2, 12)
        for group_plain, group_fast in zip(plain, fast, strict=True):
            for a, b in zip(group_plain, group_fast, strict=True):
                assert a.token_ids.tolist() == b.token_ids.tolist()
                assert a.finished == b.finished
    return engine.stats(), sum(len(r.token_ids) for g in fast for r in g)


def sampled_pvalue(spec: SpecConfig, temperature: float, top_p: float) -> tuple[float, float]:
    """Chi-square p-value of 6,000 complete sequences sampled with ``spec`` against the exact
    plain distribution, and the engine's draft acceptance rate."""
    model = with_adapter(peaky_model(vocab=6, seed=1, scale=8.0), spec, ADAPTER_VOCAB)
    engine = TorchEngine(model, EOS, 0, temperature, top_p, seed=123, spec=spec)
    p_value = sequence_pvalue(engine, [1, 4, 5, 4], max_new=3, samples=6000)
    return p_value, engine.stats().get(mn.SPEC_ACCEPTANCE_RATE, 0.0)


def assert_recorded_logprobs_exact(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    out: Sequence[Sequence[Rollout]],
    temperature: float,
    top_p: float,
) -> None:
    """Every behaviour log-prob an engine recorded equals a fresh full forward of ``model`` over
    the prompt and the completion (what the learner recomputes)."""
    for prompt, group in zip(prompts, out, strict=True):
        for r in group:
            seq = torch.tensor([list(prompt) + r.token_ids.tolist()])
            with torch.no_grad():
                logits = model(seq)[:, :-1]
            lp = token_logprobs(logits, seq[:, 1:], temperature, top_p)[0, len(prompt) - 1 :]
            np.testing.assert_allclose(r.behaviour_logprobs, lp.numpy(), atol=1e-4)

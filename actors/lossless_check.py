"""Statistical check that an engine samples complete sequences from the plain sampling distribution.

Used by the tests and by ``benchmarks/rollout.py`` (whose ``lossless`` figure must come from the
same run as its speeds). On a tiny vocabulary every possible output of ``max_new`` tokens can be
enumerated and its exact probability computed with plain forward passes; the engine's samples are
then compared with a chi-square goodness-of-fit test.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.engines.torch_engine import TorchEngine
from common.goodness_of_fit import chi_square_pvalue
from common.model import Transformer
from common.sampling import processed_logprobs


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
    keys = sorted(exact)
    index = {k: i for i, k in enumerate(keys)}
    probs = torch.tensor([exact[k] for k in keys], dtype=torch.float64).exp()
    counts = torch.zeros(len(keys), dtype=torch.float64)
    for _ in range(calls):
        for rollout in engine.generate([list(prompt)], samples // calls, max_new)[0]:
            counts[index[tuple(rollout.token_ids.tolist())]] += 1
    return chi_square_pvalue(counts, probs)

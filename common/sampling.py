"""The processed sampling distribution: logits after temperature and top-p.

Actors sample from it and record each token's log-probability under it (the behaviour
log-probability); the learner evaluates the same function on its own logits, so the PPO ratio
compares like with like. Defined once, here, because both sides need it.
"""

from __future__ import annotations

import torch


def processed_logprobs(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probabilities of the sampling distribution; tokens outside the nucleus get -inf.

    logits: [..., V] -> [..., V] float32. ``temperature == 0`` is greedy decoding: the
    distribution is one-hot at the argmax (log-prob 0 there, -inf elsewhere), so greedy runs go
    through the same sampling and speculative code paths as stochastic ones.
    """
    if temperature == 0:
        greedy = torch.full_like(logits, float("-inf"), dtype=torch.float32)
        return greedy.scatter(-1, logits.argmax(dim=-1, keepdim=True), 0.0)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scaled = logits.float() / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    if top_p >= 1.0:
        return logprobs
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
    cumulative = sorted_lp.exp().cumsum(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is
    # still below top_p, so the most likely token always stays.
    drop_sorted = (cumulative - sorted_lp.exp()) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    masked = logprobs.masked_fill(drop, float("-inf"))
    return torch.log_softmax(masked, dim=-1)


def sample_tokens(
    logprobs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from processed log-probs [B, V]; returns (tokens [B], logprobs [B])."""
    tokens = torch.multinomial(logprobs.exp(), num_samples=1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

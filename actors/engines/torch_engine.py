"""Rollout engine on the repository's own transformer: continuous batching over a paged KV cache
(docs/design.md §2.4), plain or self-speculative decoding (§2.1), and weight updates applied to
rollouts in flight (§3).

A row enters the batch with its prompt minus the last token in the cache (one prefill forward
per prompt, copied to the other completions of the prompt, or copied from a sibling still in the
batch) and the last prompt token pending: its first decoding step samples, or drafts and
verifies, the start of the completion like any other step.

This module admits, retires and delivers rows; the decoding steps are in
:mod:`actors.engines.torch_decode`, weight updates in :mod:`actors.engines.torch_swap`, the rows'
and the call's state in :mod:`actors.engines.torch_rows`.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from actors.draft_length import DraftLength
from actors.drafting import EagleDrafter, EarlyExitDrafter, NgramDrafter
from actors.engines.rollout_engine import GenerateCall, Rollout, RolloutEngine, prompt_key
from actors.engines.torch_decode import DecodeSteps
from actors.engines.torch_eagle import concat_aux
from actors.engines.torch_rows import Call, Counters, Row
from actors.engines.torch_swap import WeightSwaps
from actors.paged_cache import PagedKVCache
from common.config.actor import ActorConfig, SpecConfig
from common.config.modes import EAGLE_METHODS
from common.model import Transformer

BATCHING_MODES = ("continuous", "static")


class TorchEngine(DecodeSteps, WeightSwaps, RolloutEngine):
    """Batched rollouts; ``spec.method`` picks plain decoding or a self-speculative drafter.

    ``batching``: ``continuous`` or ``static`` (every completion of a call admitted at once, KV
    reserved for the longest prompt plus the budget, groups delivered when the call ends: the
    benchmark baseline). ``max_rows``: the most completions decoded at once (None: all of a
    call). ``max_admit``: the most that join the batch per step (None: as many as there are free
    rows), which bounds the prefill work added to one step. Sampling and log-probs are computed
    in fp32 whatever the model's dtype.
    """

    def __init__(
        self,
        model: Transformer,
        eos_id: int,
        pad_id: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        version: int = -1,
        spec: SpecConfig | None = None,
        inflight: str = ActorConfig.inflight,
        batching: str = "continuous",
        max_rows: int | None = None,
        block_size: int = 8,
        max_admit: int | None = None,
    ) -> None:
        if batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {BATCHING_MODES}, got {batching!r}")
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
        self.model = model.eval()
        self.inflight, self.batching = inflight, batching
        self.max_rows, self.max_admit = max_rows, max_admit
        self._kept, self._spare, self._adopted = {}, None, False
        self.eos_id, self.pad_id, self.version = eos_id, pad_id, version
        self.temperature, self.top_p = temperature, top_p
        self.spec = spec or SpecConfig()
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.cache = PagedKVCache(model.args, block_size, device=self.device, dtype=self.dtype)
        self.cache.draft_kv = self.spec.adapter  # full forwards also write the adapter's KV
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.early_exit = (
            EarlyExitDrafter(model, self.spec.exit_layer, adapter=self.spec.adapter)
            if self.spec.uses_early_exit
            else None
        )
        self.eagle = EagleDrafter(model, version) if self.spec.method in EAGLE_METHODS else None
        self.ngram = (
            NgramDrafter(
                self.spec.ngram_max_n, self.spec.ngram_min_n, sources=self.spec.ngram_sources
            )
            if self.spec.uses_ngram
            else None
        )
        self.draft_length = (
            DraftLength(
                self.spec.method,
                self.spec.k,
                # Prior cost of a draft pass: its share of the layers (the head: one).
                draft_cost=(
                    self.early_exit.exit_layer / model.args.num_hidden_layers
                    if self.early_exit is not None
                    else 1 / model.args.num_hidden_layers
                    if self.eagle is not None
                    else 0.0
                ),
            )
            if self.spec.adaptive and self.spec.method != "none"
            else None
        )
        self._counters = Counters()
        self._live: tuple[float, Call] | None = None  # the call in progress: start, state
        # When a dict: perf_counter() at which each prompt's first completion joined the batch.
        self.admission_log: dict[int, float] | None = None

    @torch.inference_mode()
    def _generate(self, request: GenerateCall) -> list[list[Rollout]]:
        """New weights from ``weight_source`` apply to the rows in flight according to
        ``inflight``; completions not admitted yet simply start with them."""
        prompts, n, max_new_tokens = request.prompts, request.n, request.max_new_tokens
        weight_source, on_group = request.weight_source, request.on_group
        started = time.perf_counter()
        if self.ngram is not None:
            self.ngram.begin()
        rows = [
            Row(i * n + j, i, list(p), prompt_key(p), max_new_tokens)
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        if not rows:
            return [[] for _ in prompts]
        if min(len(r.prompt) for r in rows) < 1:
            raise ValueError("every prompt needs at least one token")
        static = self.batching == "static"
        limit = len(rows) if static or self.max_rows is None else max(1, self.max_rows)
        call = Call(
            rows=rows,
            n=n,
            static=static,
            # Static batching: longest prompt + budget + the k slots a step writes.
            reserve=max(len(r.prompt) for r in rows) + max_new_tokens + self.spec.k + 1,
            on_group=on_group,
            remaining=[n] * len(prompts),
            results=[None] * len(prompts),
        )
        pending: deque[Row] = deque(rows)
        active: list[Row] = []
        self._live = (started, call)
        try:
            while pending or active:
                self._admit(call, pending, active, limit)
                emitted = self._step(active)
                done = self._advance(call, active, emitted)
                if self.inflight == "verify_on_finish" and self._kept:
                    done = self._verify_finished(call, active, done)
                for row in done:
                    self._retire(call, row)
                if weight_source is not None and (pending or active):
                    update = weight_source()
                    if update is not None:
                        self._swap(call, update, active, pending)
            self._release_unused([])
            if static:
                for group in range(len(prompts)):
                    self._deliver(call, group)
        finally:
            # Also when a callback raised: no row of this call keeps blocks into the next one.
            for row in rows:
                self.cache.release(row.id)
            self._live = None
            self._counters.gen_time_s += time.perf_counter() - started - call.callback_s
        return [r if r is not None else [] for r in call.results]

    # ------------------------------------------------------------------ admission

    def _admit(self, call: Call, pending: deque[Row], active: list[Row], limit: int) -> None:
        """Fill free rows of the batch from the queue: each newcomer gets its prompt (minus the
        last token) in the cache, computed once per prompt or copied from a sibling."""
        new: list[Row] = []
        most = len(pending) if call.static or not self.max_admit else self.max_admit
        while pending and len(active) + len(new) < limit and len(new) < most:
            new.append(pending.popleft())
        if not new:
            return
        if not active and self.early_exit is None:
            # A batch of newcomers only (the start of a call): their first step prefills the
            # prompts too, one forward for both (see _first_step).
            for row in new:
                self.cache.reserve(row.id, call.reserve if call.static else len(row.prompt))
                row.prefix = row.prompt[:-1]
            self._enter(new, active)
            return
        donors: dict[int, Row] = {}
        for row in active:
            if row.kv_version == self.version and row.head_ok:
                donors.setdefault(row.group, row)
        prefill: list[Row] = []
        copies: list[tuple[Row, Row]] = []
        for row in new:
            self.cache.reserve(row.id, call.reserve if call.static else len(row.prompt))
            donor = donors.get(row.group)
            if donor is None:
                donors[row.group] = row
                if len(row.prompt) > 1:
                    prefill.append(row)
            else:
                copies.append((donor, row))
        taps: list[torch.Tensor] | None = [] if self.eagle is not None else None
        if prefill:
            self._write_cache(prefill, [r.prompt[:-1] for r in prefill], taps)
            self._counters.full_forwards += 1
        self.cache.copy_prefix([(d.id, r.id, len(r.prompt) - 1) for d, r in copies])
        self._enter(new, active)
        if self.eagle is not None:
            # The head's states: the prompt's, from the prefill or from the donor.
            if prefill:
                for row, states in zip(prefill, concat_aux(self.model, taps), strict=True):
                    self._eagle_restart(row, states)
            for donor, row in copies:
                self._eagle_copy(donor, row, len(row.prompt) - 1)

    def _enter(self, new: list[Row], active: list[Row]) -> None:
        if self.admission_log is not None:
            now = time.perf_counter()
            for row in new:
                self.admission_log.setdefault(row.group, now)
        for row in new:
            row.last, row.pos, row.kv_version = row.prompt[-1], len(row.prompt) - 1, self.version
            row.head_pos, row.head_aux, row.head_ok = 0, [], True
            active.append(row)
            if self.ngram is not None:
                self.ngram.add_row(row.id, row.key, row.prompt)

    # ------------------------------------------------------------------ bookkeeping

    def _advance(self, call: Call, active: list[Row], emitted: list) -> list[Row]:
        """Record emitted tokens; rows that are done leave the batch (returned)."""
        done, keep = [], []
        for row, (tokens, logprobs) in zip(active, emitted, strict=True):
            before = len(row.tokens)
            if row.emit(tokens, logprobs, self.version, self.eos_id):
                done.append(row)
                continue
            row.last = row.tokens[-1]
            row.pos += len(row.tokens) - before
            if not call.static:
                self.cache.trim(row.id, row.pos + 1)  # rejected drafts' slots
            if self.ngram is not None:
                self.ngram.extend(row.id, row.tokens[before:])
            keep.append(row)
        active[:] = keep
        return done

    def _retire(self, call: Call, row: Row) -> None:
        """A done row frees its blocks; its group goes out when it was the last one."""
        self.cache.release(row.id)
        row.head_aux = []  # states for the EAGLE-3 head it will not draft with
        call.remaining[row.group] -= 1
        if call.remaining[row.group] == 0 and not call.static:
            self._deliver(call, row.group)

    def _deliver(self, call: Call, group: int) -> None:
        rows = call.rows[group * call.n : (group + 1) * call.n]
        rollouts = []
        for row in rows:
            if self.ngram is not None:
                self.ngram.remember(row.key, row.prompt + row.tokens)
            self._counters.tokens += len(row.tokens)  # delivered, not counting discarded
            rollouts.append(
                Rollout(
                    token_ids=np.asarray(row.tokens, dtype=np.int32),
                    behaviour_logprobs=np.asarray(row.logprobs, dtype=np.float32),
                    token_versions=np.asarray(row.versions, dtype=np.int32),
                    finished=row.finished,
                )
            )
        call.results[group] = rollouts
        if call.on_group is not None:
            started = time.perf_counter()
            call.on_group(group, rollouts)
            call.callback_s += time.perf_counter() - started

    def stats(self, reset: bool = True) -> dict[str, float]:
        """Counters since the last reset: throughput and acceptance figures. ``reset=False``
        reads them without resetting (also from an ``on_group`` callback, mid-call)."""
        gen_time_s = self._counters.gen_time_s
        if self._live is not None:
            started, call = self._live
            gen_time_s += time.perf_counter() - started - call.callback_s
        out = self._counters.report(gen_time_s, speculative=self.spec.method != "none")
        if reset:
            self._counters = Counters()
        return out

"""Rollout engine on the repository's own transformer: continuous batching over a paged KV cache
(docs/design.md §2.4), plain or self-speculative decoding (§2.1), and weight updates applied to
rollouts in flight (§3), for ``generate`` calls and for the turn-request stream of multi-turn
episodes (``serve``, :mod:`actors.engines.turns`): both run the same decoding step
(:meth:`TorchEngine._step`).

A row enters the batch with its prompt minus the last token in the cache (one prefill forward
per prompt, copied to the other completions of the prompt, or copied from a sibling still in the
batch) and the last prompt token pending: its first decoding step samples, or drafts and
verifies, the start of the completion like any other step.

:class:`TorchEngine` admits, retires and delivers rows, with parts it owns: the batch state
(:class:`~actors.engines.torch.rows.Batch`: cache, counters, the call in progress), the decoder
(:class:`~actors.engines.torch.decode.Decoder`, the EAGLE-3 steps in
:mod:`actors.engines.torch.eagle`) and the swapper
(:class:`~actors.engines.torch.swap.WeightSwapper`, weight updates); the state they share
(weights in use, sampling, rows, calls) is in :mod:`actors.engines.torch.rows`.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from collections.abc import Hashable, Iterator, Mapping, Sequence
from operator import attrgetter

import torch

from actors.decoding.draft_length import DraftLength
from actors.decoding.eagle import EagleDrafter
from actors.decoding.early_exit import EarlyExitDrafter
from actors.decoding.ngram import NgramDrafter
from actors.decoding.paged_cache import PagedKVCache
from actors.engines.rollout_engine import (
    EngineBase,
    GroupCallback,
    Rollout,
    WeightSource,
    prompt_key,
)
from actors.engines.torch.decode import Decoder
from actors.engines.torch.eagle import concat_aux, copy_states, restart_states
from actors.engines.torch.rows import Batch, Call, Policy, Row, Sampling
from actors.engines.torch.swap import WeightSwapper
from actors.engines.turns import EpisodeDone, TurnCallback, TurnSource
from common.config.actor import ActorConfig, SpecConfig
from common.config.modes import EAGLE_METHODS
from common.model import Transformer

IDLE_POLL_S = 0.01
"""``serve`` with no row in the batch: how long it waits for a turn request between two polls
of the weight source."""


def adaptive_draft_length(
    spec: SpecConfig, model: Transformer, early_exit: EarlyExitDrafter | None
) -> DraftLength | None:
    """The controller of ``spec.adaptive`` (None without it, or without drafting)."""
    if not spec.adaptive or spec.method == "none":
        return None
    layers = model.args.num_hidden_layers
    # Prior cost of a draft pass: its share of the layers (the head: one).
    if early_exit is not None:
        draft_cost = early_exit.exit_layer / layers
    else:
        draft_cost = 1 / layers if spec.method in EAGLE_METHODS else 0.0
    return DraftLength(spec.method, spec.k, draft_cost=draft_cost)


class TorchEngine(EngineBase):
    """Batched rollouts; ``spec.method`` picks plain decoding or a self-speculative drafter.

    ``static_batching``: every completion of a call admitted at once, KV reserved for the
    longest prompt plus the budget, groups delivered when the call ends (the benchmark baseline;
    default: continuous batching). ``max_rows``: the most completions decoded at once (None: all
    of a call). ``max_admit``: the most that join the batch per step (None: as many as there
    are free rows), which bounds the prefill work added to one step. Sampling and log-probs are
    computed in fp32 whatever the model's dtype.
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
        static_batching: bool = False,
        max_rows: int | None = None,
        block_size: int = 8,
        max_admit: int | None = None,
    ) -> None:
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
        self.static_batching = static_batching
        self.max_rows, self.max_admit = max_rows, max_admit
        self.eos_id, self.pad_id = eos_id, pad_id
        self.spec = spec = spec or SpecConfig()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.policy = Policy(model.eval(), version)
        self.sampling = Sampling(
            temperature, top_p, torch.Generator(device=self.device).manual_seed(seed)
        )
        cache = PagedKVCache(model.args, block_size, device=self.device, dtype=self.dtype)
        self.batch = Batch(cache)
        self.batch.cache.draft_kv = spec.adapter  # full forwards also write the adapter's KV
        self.early_exit = (
            EarlyExitDrafter(model, spec.exit_layer, adapter=spec.adapter)
            if spec.uses_early_exit
            else None
        )
        self.eagle = EagleDrafter(model, version) if spec.method in EAGLE_METHODS else None
        self.ngram = (
            NgramDrafter(spec.ngram_max_n, spec.ngram_min_n, sources=spec.ngram_sources)
            if spec.uses_ngram
            else None
        )
        self.draft_length = adaptive_draft_length(spec, model, self.early_exit)
        drafters = {"early_exit": self.early_exit, "ngram": self.ngram, "eagle": self.eagle}
        self.decoder = Decoder(
            self.policy,
            self.batch,
            self.sampling,
            spec,
            pad_id=pad_id,
            device=self.device,
            draft_length=self.draft_length,
            **drafters,
        )
        self.swapper = WeightSwapper(
            self.policy,
            self.batch,
            self.sampling,
            self.decoder,
            inflight=inflight,
            pad_id=pad_id,
            device=self.device,
            dtype=self.dtype,
            **drafters,
        )
        # When a dict: perf_counter() at which each prompt's first completion joined the batch.
        self.admission_log: dict[int, float] | None = None

    # What its parts hold, read through the engine (the weights in use change at every swap).
    model = property(attrgetter("policy.model"), doc="The model of the weights in use.")
    version = property(attrgetter("policy.version"), doc="Policy version of the weights in use.")
    cache = property(attrgetter("batch.cache"), doc="The paged KV cache of the batch's rows.")
    generator = property(attrgetter("sampling.generator"))
    temperature = property(attrgetter("sampling.temperature"))
    top_p = property(attrgetter("sampling.top_p"))
    inflight = property(attrgetter("swapper.inflight"))

    def _sampling_owner(self) -> Sampling:
        return self.sampling

    # ------------------------------------------------------------------ the interface

    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Between ``generate`` calls nothing is in flight: adopt the tensors, or load in place."""
        self.swapper.load(version, state_dict)

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        weight_source: WeightSource | None = None,
        on_group: GroupCallback | None = None,
    ) -> list[list[Rollout]]:
        """See :meth:`RolloutEngine.generate`. New weights from ``weight_source`` apply to the
        rows in flight according to ``inflight``; completions not admitted yet simply start with
        them."""
        started = time.perf_counter()
        if self.ngram is not None:
            self.ngram.begin()
        stop = frozenset({self.eos_id})
        rows = [
            Row(i * n + j, i, list(p), prompt_key(p), max_new_tokens, stop, share=i)
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        if not rows:
            return [[] for _ in prompts]
        if min(len(r.prompt) for r in rows) < 1:
            raise ValueError("every prompt needs at least one token")
        static = self.static_batching
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
            pending=deque(rows),
            limit=limit,
        )
        with self.batch.running(call, started):
            while call.pending or call.active:
                self._step(call, weight_source)
            self.swapper.release_unused([])
            if static:
                for group in range(len(prompts)):
                    self._deliver(call, group)
        return [r if r is not None else [] for r in call.results]

    @torch.inference_mode()
    def serve(
        self,
        source: TurnSource,
        weight_source: WeightSource | None = None,
        on_turn: TurnCallback | None = None,
    ) -> None:
        """See :meth:`RolloutEngine.serve`. Requests join the batch between decoding steps as
        rows free up (``max_rows``); a turn is a row whose prompt is the history, so new weights
        apply to the open turns as ``inflight`` says, and a turn admitted after a swap is
        prefilled, history and all, under the new weights (no KV is kept across turns)."""
        if self.static_batching:
            raise ValueError("serve needs continuous batching: static_batching=False")
        if on_turn is None:
            raise ValueError("serve needs on_turn: the finished turns go nowhere else")
        if self.ngram is not None:
            self.ngram.begin()
        limit = sys.maxsize if self.max_rows is None else self.max_rows
        call = Call([], 1, False, 0, None, [], [], on_turn=on_turn, limit=limit)
        ids = itertools.count()
        with self.batch.running(call, time.perf_counter()):
            while True:
                closed = source.closed  # read first: what was queued before it is taken below
                self._take(call, source, ids)
                if call.pending or call.active:
                    self._step(call, weight_source)
                elif closed:
                    break
                else:  # every episode waits on its environment (or none has started)
                    if weight_source is not None:
                        self._poll(call, weight_source)
                    waited = time.perf_counter()
                    source.wait(IDLE_POLL_S)
                    call.callback_s += time.perf_counter() - waited
            self.swapper.release_unused([])

    def _take(self, call: Call, source: TurnSource, ids: Iterator[int]) -> None:
        """Queue the source's requests as rows, as many as there are free rows; an episode's end
        makes its stream an n-gram history source."""
        free = max(call.limit - len(call.active) - len(call.pending), 0)
        for item in source.take(free):
            if isinstance(item, EpisodeDone):
                if self.ngram is not None:
                    self.ngram.remember(item.draft_key, item.sequence)
                continue
            item.check()
            row_id = next(ids)
            # First turns of a group share their prompt's KV; a later turn's history is its own
            # (siblings' histories differ after their first turn).
            first = item.first_turn
            share = ("first", item.group, tuple(item.prompt_ids)) if first else ("turn", row_id)
            row = Row(
                row_id,
                item.group,
                list(item.prompt_ids),
                item.draft_key,
                item.max_new_tokens,
                frozenset(item.stop_ids),
                share=share,
                request_id=item.request_id,
            )
            call.live[row.id] = row
            call.pending.append(row)

    def _step(self, call: Call, weight_source: WeightSource | None) -> None:
        """One decoding step of the batch, ``generate`` and ``serve`` alike: newcomers join,
        every row emits, rows that are done retire (after ``verify_on_finish`` verified them),
        then new weights, if published, apply to the rows in flight."""
        self._admit(call)
        done = self._advance(call, self.decoder.step(call.active))
        for row in self.swapper.verify_finished(call, done):
            self._retire(call, row)
        if weight_source is not None and (call.pending or call.active):
            self._poll(call, weight_source)

    def _poll(self, call: Call, weight_source: WeightSource) -> None:
        update = weight_source()
        if update is not None:
            self._swap(call, update)

    def _swap(self, call: Call, update: tuple[int, Mapping[str, torch.Tensor]]) -> None:
        """New weights mid-call: the swapper applies them to the rows in flight, the rows its
        verification finished retire. The weight feed meters this method as a load
        (``SWAP_METHODS`` in :mod:`common.weights.fetch.feed`)."""
        for row in self.swapper.swap(call, update):
            self._retire(call, row)

    def stats(self, reset: bool = True) -> dict[str, float]:
        """Counters since the last reset: throughput and acceptance figures. ``reset=False``
        reads them without resetting (also from an ``on_group`` callback, mid-call)."""
        return self.batch.report(speculative=self.spec.method != "none", reset=reset)

    # ------------------------------------------------------------------ admission

    def _admit(self, call: Call) -> None:
        """Fill free rows of the batch from the queue: each newcomer gets its prompt (minus the
        last token) in the cache, computed once per prompt or copied from a sibling."""
        new: list[Row] = []
        pending, active, cache = call.pending, call.active, self.batch.cache
        most = len(pending) if call.static or not self.max_admit else self.max_admit
        while pending and len(active) + len(new) < call.limit and len(new) < most:
            new.append(pending.popleft())
        if not new:
            return
        if not active and self.early_exit is None:
            # A batch of newcomers only (the start of a call): their first step prefills the
            # prompts too, one forward for both (see Decoder._first_step).
            for row in new:
                cache.reserve(row.id, call.reserve if call.static else len(row.prompt))
                row.prefix = row.prompt[:-1]
            self._enter(new, active)
            return
        donors: dict[Hashable, Row] = {}  # by share key: rows whose prompts are the same
        for row in active:
            if row.kv_version == self.version and row.head_ok:
                donors.setdefault(row.share, row)
        prefill: list[Row] = []
        copies: list[tuple[Row, Row]] = []
        for row in new:
            cache.reserve(row.id, call.reserve if call.static else len(row.prompt))
            donor = donors.get(row.share)
            if donor is None:
                donors[row.share] = row
                if len(row.prompt) > 1:
                    prefill.append(row)
            else:
                copies.append((donor, row))
        taps: list[torch.Tensor] | None = [] if self.eagle is not None else None
        if prefill:
            self.decoder.prefill(prefill, [r.prompt[:-1] for r in prefill], taps)
            self.batch.counters.full_forwards += 1
        cache.copy_prefix([(d.id, r.id, len(r.prompt) - 1) for d, r in copies])
        self._enter(new, active)
        if taps is not None:
            # The head's states: the prompt's, from the prefill or from the donor.
            if prefill:
                for row, states in zip(prefill, concat_aux(self.model, taps), strict=True):
                    restart_states(row, states)
            for donor, row in copies:
                copy_states(donor, row, len(row.prompt) - 1)

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

    def _advance(self, call: Call, emitted: list) -> list[Row]:
        """Record emitted tokens; rows that are done leave the batch (returned)."""
        done, keep = [], []
        for row, (tokens, logprobs) in zip(call.active, emitted, strict=True):
            before = len(row.tokens)
            if row.emit(tokens, logprobs, self.version):
                done.append(row)
                continue
            row.last = row.tokens[-1]
            row.pos += len(row.tokens) - before
            if not call.static:
                self.batch.cache.trim(row.id, row.pos + 1)  # rejected drafts' slots
            if self.ngram is not None:
                self.ngram.extend(row.id, row.tokens[before:])
            keep.append(row)
        call.active[:] = keep
        return done

    def _retire(self, call: Call, row: Row) -> None:
        """A done row frees its blocks; its group goes out when it was the last one (serve: its
        turn goes out, and the row is forgotten)."""
        self.batch.cache.release(row.id)
        row.head_aux = []  # states for the EAGLE-3 head it will not draft with
        if call.on_turn is not None:
            del call.live[row.id]
            if self.ngram is not None:
                self.ngram.drop_row(row.id)
            self.batch.counters.tokens += len(row.tokens)
            started = time.perf_counter()
            call.on_turn(row.turn())
            call.callback_s += time.perf_counter() - started
            return
        call.remaining[row.group] -= 1
        if call.remaining[row.group] == 0 and not call.static:
            self._deliver(call, row.group)

    def _deliver(self, call: Call, group: int) -> None:
        rows = call.rows[group * call.n : (group + 1) * call.n]
        rollouts = []
        for row in rows:
            if self.ngram is not None:
                self.ngram.remember(row.key, row.prompt + row.tokens)
            self.batch.counters.tokens += len(row.tokens)  # delivered, not counting discarded
            rollouts.append(row.rollout())
        call.results[group] = rollouts
        if call.on_group is not None:
            started = time.perf_counter()
            call.on_group(group, rollouts)
            call.callback_s += time.perf_counter() - started

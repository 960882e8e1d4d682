"""Rollout engine on the repository's own transformer: continuous batching over a block-pool KV
cache, plain or self-speculative decoding (early-exit or n-gram drafts verified by the full
model), with weight updates applied while rollouts are in flight (delayed verification, abort,
or keep).

One call generates ``n`` completions of every prompt. Completions wait in an admission queue
(prompt by prompt) and hold one of at most ``max_rows`` rows of the decoding batch while they
are decoded; a row that finishes (EOS or the length budget) leaves the batch at once, its KV
blocks go back to the pool, and the next waiting completion takes its place in the next step.
A group (the ``n`` completions of a prompt) is handed to ``on_group`` as soon as its last
completion is done. ``batching="static"`` is the former behaviour, kept as a baseline: every
completion of the call is admitted at once with KV memory reserved for the longest prompt plus
the whole budget, and groups are handed over when the whole call is done.

Rows have their own positions; the cache is written at each row's position before it is attended
to (see :mod:`common.model`), so every row accepts its own number of tokens per step. A row
enters the batch with its prompt minus the last token in the cache (one prefill forward per
prompt, copied to the other completions of the prompt, or copied from a sibling still in the
batch) and the last prompt token pending: its first decoding step samples, or drafts and
verifies, the start of the completion like any other step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from actors.drafting import EarlyExitDrafter, NgramDrafter
from actors.engines.rollout_engine import Rollout
from actors.inflight import Verification, verify_rows
from actors.paged_cache import PagedKVCache
from actors.speculative import rejection_sample
from common.config import INFLIGHT_MODES, SpecConfig
from common.model import Transformer
from common.sampling import processed_logprobs, sample_tokens

BATCHING_MODES = ("continuous", "static")
VERIFY_SCORE_BYTES = 64 * 2**20
"""Bytes of one [rows, tokens + 1, V] float32 score tensor that delayed verification builds at a
time (rows are verified in chunks that fit)."""


@dataclass
class _Row:
    """One completion: its tokens so far and, while in the batch, its decoding state."""

    id: int  # prompt index * n + sample index: the order of the result
    group: int  # prompt index
    prompt: list[int]
    key: str
    budget: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Policy version of every token (they differ within a row only in ``keep`` and
    ``verify_on_finish`` modes, before verification)."""
    finished: bool = False  # ended with EOS
    last: int = 0  # the token not yet in the cache
    pos: int = 0  # its position
    kv_version: int = 0  # weights the row's cache was computed with
    unverified: bool = False
    """verify_on_finish: in flight at a swap and still holding unverified tokens."""
    prefix: list[int] = field(default_factory=list)
    """Tokens before ``last`` not in the cache yet: the prompt, when the row's first step also
    prefills it (see ``TorchEngine._first_step``)."""

    def emit(
        self, tokens: Sequence[int], logprobs: Sequence[float], version: int, eos_id: int
    ) -> bool:
        """Append tokens up to EOS or the budget; True when the row is done."""
        for token, lp in zip(tokens, logprobs, strict=True):
            self.tokens.append(int(token))
            self.logprobs.append(float(lp))
            self.versions.append(version)
            if token == eos_id:
                self.finished = True
                return True
            if len(self.tokens) >= self.budget:
                return True
        return False

    def replace(
        self, tokens: Sequence[int], logprobs: Sequence[float], version: int, eos_id: int
    ) -> bool:
        """Set the row's tokens (after verification); True when the row is done."""
        self.tokens, self.logprobs, self.versions = [], [], []
        self.finished = False
        return self.emit(tokens, logprobs, version, eos_id)


@dataclass
class _Call:
    """One ``generate`` call."""

    rows: list[_Row]
    n: int
    static: bool
    reserve: int  # static batching: KV slots reserved per row at admission
    on_group: Callable[[int, list[Rollout]], None] | None
    remaining: list[int]  # per group: completions not done yet
    results: list[list[Rollout] | None]
    callback_s: float = 0.0


@dataclass
class _Counters:
    tokens: int = 0
    full_forwards: int = 0
    draft_layer_passes: int = 0
    verify_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    gen_time_s: float = 0.0
    swaps: int = 0
    inflight_tokens: int = 0
    """Generated tokens of unfinished rows when new weights arrived."""
    salvaged_tokens: int = 0
    wasted_tokens: int = 0
    verify_forward_tokens: int = 0
    gap_proposed: dict[int, int] = field(default_factory=dict)
    gap_accepted: dict[int, int] = field(default_factory=dict)


class TorchEngine:
    """Batched rollouts; ``spec.method`` picks plain decoding or a self-speculative drafter.

    ``batching``: ``continuous`` (default) or ``static`` (see the module docstring). ``max_rows``:
    the most completions decoded at once (None: all of a call). ``max_admit``: the most that
    join the batch per step (None: as many as there are free rows), which bounds the prefill
    work added to one step. ``block_size``: KV slots per
    block of the cache pool (:class:`actors.paged_cache.PagedKVCache`), which is kept in the
    model's dtype; sampling and log-probs are computed in fp32 whatever the model's dtype.
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
        inflight: str = "verify_on_swap",
        batching: str = "continuous",
        max_rows: int | None = None,
        block_size: int = 8,
        max_admit: int | None = None,
    ) -> None:
        if inflight not in INFLIGHT_MODES:
            raise ValueError(f"inflight must be one of {INFLIGHT_MODES}, got {inflight!r}")
        if batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {BATCHING_MODES}, got {batching!r}")
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
        self.model = model.eval()
        self.inflight = inflight
        self.batching = batching
        self.max_rows = max_rows
        self.max_admit = max_admit
        # Weights of older versions still needed to verify in-flight tokens exactly, and a spare
        # model instance so a swap does not allocate (double buffering).
        self._kept: dict[int, Transformer] = {}
        self._spare: Transformer | None = None
        self._adopted = False  # whether models take their published tensors (see _adoptable)
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.temperature = temperature
        self.top_p = top_p
        self.version = version
        self.spec = spec or SpecConfig()
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.cache = PagedKVCache(model.args, block_size, device=self.device, dtype=self.dtype)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.early_exit = (
            EarlyExitDrafter(model, self.spec.exit_layer)
            if self.spec.method in ("early_exit", "hybrid")
            else None
        )
        self.ngram = (
            NgramDrafter(
                self.spec.ngram_max_n, self.spec.ngram_min_n, sources=self.spec.ngram_sources
            )
            if self.spec.method in ("ngram", "hybrid")
            else None
        )
        self._counters = _Counters()
        self._live: tuple[float, _Call] | None = None  # the call in progress: start, state
        self.admission_log: dict[int, float] | None = None
        """When set to a dict: the time (``time.perf_counter``) each prompt index's first
        completion joined the batch, for group latencies (benchmarks/batching.py)."""

    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Between ``generate`` calls nothing is in flight: adopt the tensors, or load in place."""
        if self._adoptable(state_dict):
            self._set_model(self._adopt(state_dict), version)
            self._spare = None
            return
        self.model.load_state_dict(dict(state_dict), strict=True)
        self.version = version

    def _adoptable(self, state_dict: Mapping[str, torch.Tensor]) -> bool:
        """Whether a model can take the published tensors themselves as its parameters: on the
        CPU, in the model's dtype. The weights then exist once (the fetched buffer), not twice;
        the engine never writes to them, as the store asks."""
        return self.device.type == "cpu" and all(
            t.device.type == "cpu" and (t.dtype == self.dtype or not t.is_floating_point())
            for t in state_dict.values()
        )

    def _adopt(self, state_dict: Mapping[str, torch.Tensor]) -> Transformer:
        with torch.inference_mode(False), torch.device("meta"):
            model = Transformer(self.model.args)
        model.load_state_dict(dict(state_dict), strict=True, assign=True)
        self._adopted = True
        return model.eval()

    def _keep_spare(self, old: Transformer) -> None:
        """Keep a retired model to load the next version into (double buffering), unless models
        adopt their published tensors: then it holds only an old version's buffer."""
        self._spare = None if self._adopted else old

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        weight_source: Callable[[], tuple[int, Mapping[str, torch.Tensor]] | None] | None = None,
        on_group: Callable[[int, list[Rollout]], None] | None = None,
        max_rows: int | None = None,
    ) -> list[list[Rollout]]:
        """``n`` completions per prompt; result[i][j] is completion j of prompt i.

        ``weight_source`` is polled between decoding steps; when it returns ``(version,
        state_dict)`` the new weights are applied to the rows in flight according to
        ``inflight`` (see :mod:`actors.inflight`); completions not admitted yet simply start
        with them. ``on_group(i, rollouts)`` is called once per prompt, as soon as its ``n``
        completions are done (static batching: when the call is done). ``max_rows`` overrides
        the engine's for this call."""
        started = time.perf_counter()
        if self.ngram is not None:
            self.ngram.begin()
        rows = [
            _Row(i * n + j, i, list(p), _prompt_key(p), max_new_tokens)
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        if not rows:
            return [[] for _ in prompts]
        if min(len(r.prompt) for r in rows) < 1:
            raise ValueError("every prompt needs at least one token")
        static = self.batching == "static"
        limit = max_rows if max_rows is not None else self.max_rows
        limit = len(rows) if static or limit is None else max(1, limit)
        call = _Call(
            rows=rows,
            n=n,
            static=static,
            # The former preallocation: longest prompt + budget + the k slots a step writes.
            reserve=max(len(r.prompt) for r in rows) + max_new_tokens + self.spec.k + 1,
            on_group=on_group,
            remaining=[n] * len(prompts),
            results=[None] * len(prompts),
        )
        pending: deque[_Row] = deque(rows)
        active: list[_Row] = []
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

    def _admit(self, call: _Call, pending: deque[_Row], active: list[_Row], limit: int) -> None:
        """Fill free rows of the batch from the queue: each newcomer gets its prompt (minus the
        last token) in the cache, computed once per prompt or copied from a sibling."""
        new: list[_Row] = []
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
        donors: dict[int, _Row] = {}
        for row in active:
            if row.kv_version == self.version:
                donors.setdefault(row.group, row)
        prefill: list[_Row] = []
        copies: list[tuple[int, int, int]] = []
        for row in new:
            self.cache.reserve(row.id, call.reserve if call.static else len(row.prompt))
            donor = donors.get(row.group)
            if donor is None:
                donors[row.group] = row
                if len(row.prompt) > 1:
                    prefill.append(row)
            else:
                copies.append((donor.id, row.id, len(row.prompt) - 1))
        if prefill:
            self._write_cache(prefill, [r.prompt[:-1] for r in prefill])
            self._counters.full_forwards += 1
        self.cache.copy_prefix(copies)
        self._enter(new, active)

    def _enter(self, new: list[_Row], active: list[_Row]) -> None:
        if self.admission_log is not None:
            now = time.perf_counter()
            for row in new:
                self.admission_log.setdefault(row.group, now)
        for row in new:
            row.last, row.pos, row.kv_version = row.prompt[-1], len(row.prompt) - 1, self.version
            active.append(row)
            if self.ngram is not None:
                self.ngram.add_row(row.id, row.key, row.prompt)

    def _write_cache(self, rows: list[_Row], sequences: list[list[int]]) -> int:
        """Run the current weights over each row's ``sequence`` from position 0, writing its
        cache (no LM head: nothing is sampled); returns the tokens pushed through."""
        width = max(len(s) for s in sequences)
        if width == 0:
            return 0
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long, device=self.device)
        for i, seq in enumerate(sequences):
            ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        positions = torch.arange(width, device=self.device).expand(len(rows), -1)
        cache = self.cache.bind([r.id for r in rows])
        layers = self.model.args.num_hidden_layers
        self.model.run_layers(self.model.model.embed_tokens(ids), positions, cache, 0, layers)
        return ids.numel()

    def _bind(self, active: list[_Row], ahead: Sequence[int]) -> PagedKVCache:
        """Blocks for every row's pending token and ``ahead[i]`` slots after it; binds them."""
        for row, extra in zip(active, ahead, strict=True):
            self.cache.reserve(row.id, row.pos + 1 + extra)
        return self.cache.bind([r.id for r in active])

    # ------------------------------------------------------------------ decoding steps

    def _step(self, active: list[_Row]) -> list:
        """One decoding step of every row of the batch: per row (tokens, logprobs) emitted."""
        if active[0].prefix or any(r.prefix for r in active):
            return self._first_step(active)
        last = torch.tensor([r.last for r in active], dtype=torch.long, device=self.device)
        pos = torch.tensor([r.pos for r in active], dtype=torch.long, device=self.device)
        k = self.spec.k
        if self.early_exit is not None and self.ngram is not None:
            # Hybrid: n-gram drafts where every row has a match (no draft forward); otherwise
            # the early exit drafts, continuing after each row's n-gram match if it has one.
            # Which way a step goes depends only on the tokens so far, so both stay exact.
            drafts = self.ngram.propose_rows([r.id for r in active], k)
            if all(drafts):
                return self._verify_ngram(active, drafts, last, pos)
            return self._early_exit_step(self._bind(active, [k] * len(active)), last, pos, drafts)
        if self.early_exit is not None:
            return self._early_exit_step(self._bind(active, [k] * len(active)), last, pos)
        if self.ngram is not None:
            drafts = self.ngram.propose_rows([r.id for r in active], k)
            return self._verify_ngram(active, drafts, last, pos)
        return self._plain_step(self._bind(active, [0] * len(active)), last, pos)

    def _first_step(self, active: list[_Row]) -> list:
        """Newcomers' first step, prompts included: each row's prompt, then its n-gram drafts
        (copied from earlier completions of the prompt), through one forward that writes the
        cache and scores the start of the completion, so a prompt answered before can be
        answered again in one pass. Rows with the same prompt and drafts (a GRPO group) share
        one row of that forward and copy its cache."""
        k = self.spec.k
        drafts: list[list[int]] = [[] for _ in active]
        if self.ngram is not None:
            drafts = self.ngram.propose_rows([r.id for r in active], k)
        seqs = [(*r.prefix, r.last, *d) for r, d in zip(active, drafts, strict=True)]
        first: dict[tuple[int, ...], int] = {}
        for j, seq in enumerate(seqs):
            first.setdefault(seq, j)
        unique = list(first)
        slot = {seq: i for i, seq in enumerate(unique)}
        for row, seq in zip(active, seqs, strict=True):
            self.cache.reserve(row.id, len(seq))
        width = max(len(seq) for seq in unique)
        ids = torch.full((len(unique), width), self.pad_id, dtype=torch.long, device=self.device)
        for i, seq in enumerate(unique):
            ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        positions = torch.arange(width, device=self.device).expand(len(unique), -1)
        cache = self.cache.bind([active[first[seq]].id for seq in unique])
        hidden = self.model.hidden_states(ids, positions, cache)  # [U, W, H]
        self._counters.full_forwards += 1
        self.cache.copy_prefix(
            [
                (active[first[seq]].id, row.id, len(seq))
                for j, (row, seq) in enumerate(zip(active, seqs, strict=True))
                if first[seq] != j
            ]
        )
        inverse = torch.tensor([slot[seq] for seq in seqs], device=self.device)  # [B]
        kmax = max(len(d) for d in drafts)
        start = torch.tensor([len(r.prefix) for r in active], device=self.device)
        # Scores of the first completion token and of each draft: offsets len(prefix) + 0..K.
        at = (start[:, None] + torch.arange(kmax + 1, device=self.device)).clamp(max=width - 1)
        # The LM head only where scores are read, not over every prompt position.
        logits = self.model.lm_head(hidden[inverse[:, None], at]).float()  # [B, K+1, V]
        target = processed_logprobs(logits, self.temperature, self.top_p)
        for row in active:
            row.prefix = []
        if kmax == 0:
            tokens, token_lp = sample_tokens(target[:, 0], self.generator)
            return [([t], [lp]) for t, lp in zip(tokens.tolist(), token_lp.tolist(), strict=True)]
        draft_tokens, num_drafts = self._pad_drafts(drafts, kmax)
        result = rejection_sample(target, draft_tokens, None, num_drafts, generator=self.generator)
        return self._spec_emitted(result, num_drafts)

    def _pad_drafts(self, drafts: list[list[int]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts as [B, K] (padded) and their lengths [B]."""
        draft_tokens = torch.full(
            (len(drafts), k), self.pad_id, dtype=torch.long, device=self.device
        )
        for i, d in enumerate(drafts):
            draft_tokens[i, : len(d)] = torch.tensor(d, dtype=torch.long)
        return draft_tokens, torch.tensor([len(d) for d in drafts], device=self.device)

    def _plain_step(self, cache: PagedKVCache, last: torch.Tensor, pos: torch.Tensor) -> list:
        logits = self.model(last[:, None], pos[:, None], cache)[:, 0]  # [B, V] fp32
        self._counters.full_forwards += 1
        tokens, token_lp = sample_tokens(
            processed_logprobs(logits, self.temperature, self.top_p), self.generator
        )
        return [([t], [lp]) for t, lp in zip(tokens.tolist(), token_lp.tolist(), strict=True)]

    def _early_exit_step(
        self,
        cache: PagedKVCache,
        last: torch.Tensor,
        pos: torch.Tensor,
        forced: list[list[int]] | None = None,
    ) -> list:
        assert self.early_exit is not None
        k = self.spec.k
        draft = self.early_exit.draft(
            last, pos, cache, k, self.temperature, self.top_p, self.generator, forced
        )
        target = processed_logprobs(
            self.early_exit.verify_logits(draft, pos, cache), self.temperature, self.top_p
        )  # [B, K+1, V]
        self._counters.draft_layer_passes += (k + 1) * self.early_exit.exit_layer
        self._counters.full_forwards += 1
        result = rejection_sample(target, draft.tokens, draft.logprobs, generator=self.generator)
        num_drafts = torch.full_like(result.accepted, k)
        return self._spec_emitted(result, num_drafts)

    def _verify_ngram(
        self, active: list[_Row], drafts: list[list[int]], last: torch.Tensor, pos: torch.Tensor
    ) -> list:
        k = max(len(d) for d in drafts)
        cache = self._bind(active, [len(d) for d in drafts])
        if k == 0:
            return self._plain_step(cache, last, pos)
        draft_tokens, num_drafts = self._pad_drafts(drafts, k)
        inputs = torch.cat([last[:, None], draft_tokens], dim=1)  # [B, K+1]
        positions = pos[:, None] + torch.arange(k + 1, device=self.device)
        target = processed_logprobs(
            self.model(inputs, positions, cache), self.temperature, self.top_p
        )  # [B, K+1, V]
        self._counters.full_forwards += 1
        result = rejection_sample(target, draft_tokens, None, num_drafts, generator=self.generator)
        return self._spec_emitted(result, num_drafts)

    def _spec_emitted(self, result, num_drafts: torch.Tensor) -> list:
        """Per-row (tokens, logprobs) from a SpecResult, and the acceptance counters."""
        self._counters.verify_steps += len(num_drafts)
        accepted = result.accepted.tolist()
        proposed = num_drafts.tolist()
        kmax = max(proposed) if proposed else 0
        if len(self._counters.proposed_at) < kmax:
            grow = kmax - len(self._counters.proposed_at)
            self._counters.proposed_at += [0] * grow
            self._counters.accepted_at += [0] * grow
        for a, m in zip(accepted, proposed, strict=True):
            self._counters.proposed += m
            self._counters.accepted += a
            for i in range(m):
                self._counters.proposed_at[i] += 1
                self._counters.accepted_at[i] += int(a > i)
        emitted_n = result.num_emitted.tolist()
        tokens = result.tokens.tolist()
        logprobs = result.logprobs.tolist()
        return [
            (tokens[b][: emitted_n[b]], logprobs[b][: emitted_n[b]]) for b in range(len(accepted))
        ]

    # ------------------------------------------------------------------ bookkeeping

    def _advance(self, call: _Call, active: list[_Row], emitted: list) -> list[_Row]:
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

    def _retire(self, call: _Call, row: _Row) -> None:
        """A done row frees its blocks; its group goes out when it was the last one."""
        self.cache.release(row.id)
        call.remaining[row.group] -= 1
        if call.remaining[row.group] == 0 and not call.static:
            self._deliver(call, row.group)

    def _deliver(self, call: _Call, group: int) -> None:
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

    # ------------------------------------------------------------------ weights in flight

    def _new_model(self, state_dict: Mapping[str, torch.Tensor]) -> Transformer:
        # Built and loaded outside inference mode (generate runs inside it): parameters made
        # there would be inference tensors that a later in-place load_weights may not update.
        if self._adoptable(state_dict):
            self._spare = None  # the fetched tensors become the new model: nothing to reuse
            return self._adopt(state_dict)
        with torch.inference_mode(False):
            model = self._spare or Transformer(self.model.args).to(self.device, self.dtype)
            self._spare = None
            model.load_state_dict(dict(state_dict), strict=True)
        return model.eval()

    def _set_model(self, model: Transformer, version: int) -> None:
        self.model, self.version = model, version
        if self.early_exit is not None:
            self.early_exit.model = model

    def _swap(
        self,
        call: _Call,
        update: tuple[int, Mapping[str, torch.Tensor]],
        active: list[_Row],
        pending: deque[_Row],
    ) -> None:
        """Apply new weights to the rows in flight according to ``self.inflight``."""
        version, state_dict = update
        old_model, old_version = self.model, self.version
        self._set_model(self._new_model(state_dict), version)
        self._counters.swaps += 1
        self._counters.inflight_tokens += sum(len(r.tokens) for r in active)
        if self.inflight == "keep":
            # PipelineRL-style baseline: stale tokens (and their stale KV) stay; the learner's
            # truncated importance weights are left to correct them.
            self._keep_spare(old_model)
            return
        if self.inflight == "abort":
            # Back to the head of the queue, in order: they start again with the new weights.
            for row in reversed(active):
                self._counters.wasted_tokens += len(row.tokens)
                row.replace([], [], version, self.eos_id)
                self.cache.release(row.id)
                pending.appendleft(row)
            active.clear()
            self._keep_spare(old_model)
            return
        if not active:
            self._keep_spare(old_model)
            return
        if self.inflight == "verify_on_finish":
            # Recompute the rows' cache under the new weights in their own blocks (the token not
            # yet in the cache stays pending) and keep the old weights until every row holding
            # old tokens is verified.
            self._kept[old_version] = old_model
            for row in active:
                row.unverified = True
                row.kv_version = version
            self._counters.verify_forward_tokens += self._write_cache(
                active, [r.prompt + r.tokens[:-1] for r in active]
            )
            return
        verified = self._verify(active, {**self._kept, old_version: old_model}, bonus=True)
        self._keep_spare(old_model)
        done = self._apply_verification(call, list(active), verified, active)
        for row in done:
            self._retire(call, row)

    def _verify(
        self, rows: list[_Row], old_models: Mapping[int, Transformer], bonus: bool
    ) -> Verification:
        """Delayed verification of ``rows`` against the current weights; the new cache is
        written into the rows' own blocks."""
        for row in rows:
            self.cache.reserve(row.id, len(row.prompt) + len(row.tokens))
        # Rows are verified a few at a time so that their [rows, tokens + 1, V] score tensors
        # stay within VERIFY_SCORE_BYTES (a real vocabulary makes them the largest thing here).
        per_row = (max(len(r.tokens) for r in rows) + 1) * self.model.args.vocab_size * 4
        step = max(1, VERIFY_SCORE_BYTES // per_row)
        parts = [
            verify_rows(
                self.model,
                self.version,
                old_models,
                [r.prompt for r in chunk],
                [r.tokens for r in chunk],
                [r.versions for r in chunk],
                self.temperature,
                self.top_p,
                self.cache.bind([r.id for r in chunk]),
                self.generator,
                bonus=bonus,
                pad_id=self.pad_id,
            )
            for chunk in (rows[i : i + step] for i in range(0, len(rows), step))
        ]
        return Verification.concat(parts)

    def _apply_verification(
        self, call: _Call, rows: list[_Row], verified: Verification, active: list[_Row]
    ) -> list[_Row]:
        """Replace the rows' tokens with the verified ones. Rows still going are (or go back)
        in ``active``; the rows that are done are returned."""
        self._counters.verify_forward_tokens += verified.forward_tokens
        done = []
        going = {id(r) for r in active}
        for j, row in enumerate(rows):
            accepted = verified.accepted[j]
            # Tokens already of the new version are accepted by construction; only stale ones
            # measure drift and count as salvaged. Everything after a cut is discarded.
            stale = [(i, gap) for i, gap in enumerate(verified.gaps[j]) if gap > 0]
            self._counters.salvaged_tokens += sum(i < accepted for i, _ in stale)
            self._counters.wasted_tokens += len(verified.gaps[j]) - accepted
            for i, gap in stale:
                self._counters.gap_proposed[gap] = self._counters.gap_proposed.get(gap, 0) + 1
                self._counters.gap_accepted[gap] = self._counters.gap_accepted.get(gap, 0) + int(
                    i < accepted
                )
            row.kv_version = self.version
            if row.replace(verified.tokens[j], verified.logprobs[j], self.version, self.eos_id):
                done.append(row)
                continue
            if self.ngram is not None:
                self.ngram.truncate(row.id, len(row.prompt) + accepted)
                self.ngram.extend(row.id, row.tokens[accepted:])
            row.last, row.pos = row.tokens[-1], len(row.prompt) + len(row.tokens) - 1
            if not call.static:
                self.cache.trim(row.id, row.pos + 1)
            if id(row) not in going:
                active.append(row)
        if done:
            gone = {id(r) for r in done}
            active[:] = [r for r in active if id(r) not in gone]
        return done

    def _verify_finished(self, call: _Call, active: list[_Row], done: list[_Row]) -> list[_Row]:
        """verify_on_finish: rows that just finished holding tokens of older versions are checked
        against the current weights; a cut row goes back into the batch and decodes on. Returns
        the rows that are done for good."""
        due = [r for r in done if r.unverified]
        final = [r for r in done if not r.unverified]
        if due:
            for row in due:
                row.unverified = False
            verified = self._verify(due, self._kept, bonus=False)
            final += self._apply_verification(call, due, verified, active)
        self._release_unused(active)
        return final

    def _release_unused(self, active: list[_Row]) -> None:
        """Drop kept weights no row still needs (verification of finished rows happens first)."""
        if not self._kept:
            return
        needed = {v for r in active for v in r.versions}
        for version in [v for v in self._kept if v not in needed]:
            self._keep_spare(self._kept.pop(version))

    def stats(self, reset: bool = True) -> dict[str, float]:
        """Counters since the last reset: throughput and acceptance figures. ``reset=False``
        reads them without resetting (also from an ``on_group`` callback, mid-call)."""
        c = self._counters
        gen_time_s = c.gen_time_s
        if self._live is not None:
            started, call = self._live
            gen_time_s += time.perf_counter() - started - call.callback_s
        out = {
            "actor/tokens": float(c.tokens),
            "actor/forward_passes": float(c.full_forwards),
            "actor/gen_time_s": gen_time_s,
            "actor/tokens_per_s": c.tokens / gen_time_s if gen_time_s else 0.0,
            "spec/forwards_per_token": c.full_forwards / c.tokens if c.tokens else 0.0,
        }
        if self.spec.method != "none":
            out["spec/acceptance_rate"] = c.accepted / c.proposed if c.proposed else 0.0
            # Tokens emitted per verification: accepted drafts + the one sampled token.
            out["spec/mean_accepted_len"] = (
                (c.accepted + c.verify_steps) / c.verify_steps if c.verify_steps else 0.0
            )
            out["spec/draft_layer_passes_per_token"] = (
                c.draft_layer_passes / c.tokens if c.tokens else 0.0
            )
            for i, (p, a) in enumerate(zip(c.proposed_at, c.accepted_at, strict=True)):
                out[f"spec/acceptance_pos{i + 1}"] = a / p if p else 0.0
        if c.swaps:
            out["verify/swaps"] = float(c.swaps)
            out["verify/inflight_tokens"] = float(c.inflight_tokens)
            out["verify/salvaged_tokens"] = float(c.salvaged_tokens)
            out["verify/wasted_tokens"] = float(c.wasted_tokens)
            out["verify/forward_tokens"] = float(c.verify_forward_tokens)
            # Share of the tokens in flight at swaps that survived (abort: 0; keep: not checked).
            out["verify/salvaged_frac"] = (
                c.salvaged_tokens / c.inflight_tokens if c.inflight_tokens else 1.0
            )
            for gap, proposed in sorted(c.gap_proposed.items()):
                out[f"verify/acceptance_gap{gap}"] = c.gap_accepted.get(gap, 0) / proposed
        if reset:
            self._counters = _Counters()
        return out


def _prompt_key(prompt: Sequence[int]) -> str:
    return ",".join(map(str, prompt))

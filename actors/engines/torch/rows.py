"""The torch engine's state, which its parts (:mod:`actors.engines.torch.engine`) share: the
weights in use (:class:`Policy`), how tokens are drawn (:class:`Sampling`), one completion or
turn (:class:`Row`), one ``generate`` or ``serve`` call (:class:`Call`), one decoding step's output
(:class:`Emitted`), the counters behind ``TorchEngine.stats`` (:class:`Counters`) and the batch
state that holds the cache, the counters and the call in progress (:class:`Batch`)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from actors.decoding.draft_length import EARLY_EXIT, NGRAM, PLAIN
from actors.decoding.paged_cache import PagedKVCache
from actors.decoding.sampler import SpecResult
from actors.engines.rollout_engine import Rollout
from actors.engines.turns import TurnResult
from common import metric_names as mn
from common.model import Transformer


@dataclass
class Policy:
    """The weights decoding uses now; a weight swap replaces both."""

    model: Transformer
    version: int


@dataclass
class Sampling:
    """How tokens are drawn: the processed distribution (``temperature``, ``top_p``; computed in
    fp32) and the generator every draw takes its random numbers from."""

    temperature: float
    top_p: float
    generator: torch.Generator


@dataclass
class Row:
    """One completion (``generate``) or turn (``serve``): its tokens so far and, while in the
    batch, its decoding state."""

    id: int  # generate: prompt index * n + sample index, the order of the result; serve: unique
    group: int  # prompt index
    prompt: list[int]  # serve: the episode's whole history
    key: str  # n-gram drafting: the prompt's key (generate), the task's draft_key (serve)
    budget: int
    stop_ids: frozenset[int] = frozenset()  # the row ends at the first of these it emits
    # Rows with equal share keys have the same prompt: one's prompt KV may be copied to another.
    share: Hashable = None
    request_id: int = -1  # serve: the TurnRequest's id
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # Policy version of every token (mixed only in keep and verify_on_finish, before verification)
    versions: list[int] = field(default_factory=list)
    finished: bool = False  # ended with EOS
    last: int = 0  # the token not yet in the cache
    pos: int = 0  # its position
    kv_version: int = 0  # weights the row's cache was computed with
    unverified: bool = False  # verify_on_finish: holds tokens from before a swap, unverified
    # Tokens before ``last`` not in the cache yet: the prompt, when the first step prefills it.
    prefix: list[int] = field(default_factory=list)
    # spec.method=eagle3 (actors.engines.torch.eagle): the head's KV is valid at positions
    # [0, head_pos); the policy's auxiliary states [n, n_aux * H] of positions [head_pos, pos),
    # not yet through the head, in chunks; head_ok False: the row drafts no more (its states
    # are of older weights, ``keep``).
    head_pos: int = 0
    head_aux: list[Tensor] = field(default_factory=list)
    head_ok: bool = True

    def span(self, lo: int, hi: int) -> list[int]:
        """Tokens at positions [lo, hi) of prompt + completion."""
        n = len(self.prompt)
        return self.prompt[lo:hi] + self.tokens[max(lo - n, 0) : max(hi - n, 0)]

    def head_pending(self) -> int:
        """Auxiliary states waiting for the EAGLE-3 head (``head_aux``)."""
        return sum(int(a.shape[0]) for a in self.head_aux)

    def emit(self, tokens: Sequence[int], logprobs: Sequence[float], version: int) -> bool:
        """Append tokens up to a stop id or the budget (accepted drafts after it are dropped);
        True when the row is done."""
        for token, lp in zip(tokens, logprobs, strict=True):
            self.tokens.append(int(token))
            self.logprobs.append(float(lp))
            self.versions.append(version)
            if token in self.stop_ids:
                self.finished = True
                return True
            if len(self.tokens) >= self.budget:
                return True
        return False

    def replace(self, tokens: Sequence[int], logprobs: Sequence[float], version: int) -> bool:
        """Set the row's tokens (after verification); True when the row is done."""
        self.tokens, self.logprobs, self.versions = [], [], []
        self.finished = False
        return self.emit(tokens, logprobs, version)

    def rollout(self) -> Rollout:
        """The finished completion (``generate``)."""
        return Rollout(
            token_ids=np.asarray(self.tokens, dtype=np.int32),
            behaviour_logprobs=np.asarray(self.logprobs, dtype=np.float32),
            token_versions=np.asarray(self.versions, dtype=np.int32),
            finished=self.finished,
        )

    def turn(self) -> TurnResult:
        """The finished turn (``serve``)."""
        return TurnResult(
            request_id=self.request_id,
            token_ids=np.asarray(self.tokens, dtype=np.int32),
            behaviour_logprobs=np.asarray(self.logprobs, dtype=np.float32),
            token_versions=np.asarray(self.versions, dtype=np.int32),
            stop="stop_id" if self.finished else "length",
        )


@dataclass
class Call:
    """One ``generate`` call: its rows, those waiting to be admitted (``pending``, in order) and
    those in the batch (``active``); or one ``serve`` call (``on_turn`` set), whose rows are in
    ``live`` until their turn is delivered (``rows`` stays empty: only live rows are kept)."""

    rows: list[Row]
    n: int
    static: bool
    reserve: int  # static batching: KV slots reserved per row at admission
    on_group: Callable[[int, list[Rollout]], None] | None
    remaining: list[int]  # per group: completions not done yet
    results: list[list[Rollout] | None]
    # Time not spent generating: in callbacks, and (serve) waiting for turn requests.
    callback_s: float = 0.0
    pending: deque[Row] = field(default_factory=deque)
    active: list[Row] = field(default_factory=list)
    on_turn: Callable[[TurnResult], None] | None = None  # serve: a turn is final
    live: dict[int, Row] = field(default_factory=dict)  # serve: the rows not delivered yet
    limit: int = 1  # the most rows in the batch at once


@dataclass(frozen=True)
class Emitted:
    """One decoding step's output: per row of the batch, the tokens and their log-probs it
    emits; when the step verified drafts, per row the drafts accepted and proposed."""

    rows: list[tuple[list[int], list[float]]]
    accepted: list[int] | None = None
    proposed: list[int] | None = None

    @classmethod
    def sampled(cls, tokens: Tensor, logprobs: Tensor) -> Emitted:
        """One sampled token per row (``tokens``, ``logprobs``: [B])."""
        pairs = zip(tokens.tolist(), logprobs.tolist(), strict=True)
        return cls([([t], [lp]) for t, lp in pairs])

    @classmethod
    def verified(cls, result: SpecResult, num_drafts: Tensor) -> Emitted:
        """What a verification emits; ``num_drafts`` [B]: the drafts each row proposed."""
        accepted, proposed = result.accepted.tolist(), num_drafts.tolist()
        counts, tokens = result.num_emitted.tolist(), result.tokens.tolist()
        logprobs = result.logprobs.tolist()
        rows = [(tokens[b][: counts[b]], logprobs[b][: counts[b]]) for b in range(len(accepted))]
        return cls(rows, accepted, proposed)


class Counters:
    """What ``TorchEngine.stats`` reports, counted since its last reset."""

    def __init__(self) -> None:
        # Decoding: delivered tokens (discarded ones not counted), forwards of the full model,
        # layer passes of the early-exit drafter, wall time spent generating.
        self.tokens, self.full_forwards, self.draft_layer_passes = 0, 0, 0
        self.gen_time_s = 0.0
        # Speculative decoding: verification steps (one per row and step), drafts proposed and
        # accepted, in total and per draft position.
        self.verify_steps, self.proposed, self.accepted = 0, 0, 0
        self.proposed_at: list[int] = []
        self.accepted_at: list[int] = []
        # Forwards that verified drafts and the tokens they emitted (all rows).
        self.spec_forwards, self.spec_tokens = 0, 0
        # Adaptive draft length (spec.adaptive): decoding steps by chosen k (0 = plain) and,
        # for hybrid, by kind (plain, ngram, early_exit).
        self.chosen_k: list[int] = []
        self.chosen_kind: dict[str, int] = {}
        # Weights in flight: swaps; generated tokens of unfinished rows when new weights
        # arrived, how many of them were kept or discarded; tokens pushed through verification
        # forwards; stale tokens verified and accepted by version gap.
        self.swaps, self.inflight_tokens = 0, 0
        self.salvaged_tokens, self.wasted_tokens, self.verify_forward_tokens = 0, 0, 0
        self.gap_proposed: dict[int, int] = {}
        self.gap_accepted: dict[int, int] = {}
        # spec.method=eagle3: the weights version of the head that drafted last (the policy's).
        self.draft_version: int | None = None

    def count_drafts(self, accepted: list[int], proposed: list[int]) -> None:
        """Acceptance counters of one verification step (per row: accepted, proposed drafts)."""
        self.verify_steps += len(proposed)
        self.spec_forwards += 1
        self.spec_tokens += sum(accepted) + len(accepted)  # the accepted drafts + one each
        kmax = max(proposed) if proposed else 0
        if len(self.proposed_at) < kmax:
            grow = kmax - len(self.proposed_at)
            self.proposed_at += [0] * grow
            self.accepted_at += [0] * grow
        for a, m in zip(accepted, proposed, strict=True):
            self.proposed += m
            self.accepted += a
            for i in range(m):
                self.proposed_at[i] += 1
                self.accepted_at[i] += int(a > i)

    def count_choice(self, kind: str, k: int, k_max: int, method: str) -> None:
        """One decoding step's adaptive choice: ``kind`` (plain or a drafter) and ``k``."""
        if len(self.chosen_k) <= k_max:
            self.chosen_k += [0] * (k_max + 1 - len(self.chosen_k))
        self.chosen_k[k] += 1
        if method == "hybrid":
            if not self.chosen_kind:
                self.chosen_kind = dict.fromkeys((PLAIN, NGRAM, EARLY_EXIT), 0)
            self.chosen_kind[kind] += 1

    def count_stale(self, gaps: list[int], accepted: int) -> None:
        """One verified row: ``gaps[i]`` is token ``i``'s version gap; the first ``accepted``
        tokens were kept. Tokens already of the new version are accepted by construction; only
        stale ones measure drift and count as salvaged. Everything after a cut is discarded."""
        stale = [(i, gap) for i, gap in enumerate(gaps) if gap > 0]
        self.salvaged_tokens += sum(i < accepted for i, _ in stale)
        self.wasted_tokens += len(gaps) - accepted
        for i, gap in stale:
            self.gap_proposed[gap] = self.gap_proposed.get(gap, 0) + 1
            self.gap_accepted[gap] = self.gap_accepted.get(gap, 0) + int(i < accepted)

    def report(self, gen_time_s: float, speculative: bool) -> dict[str, float]:
        """The figures: throughput, acceptance (``speculative``) and in-flight weights."""
        out = {
            mn.ACTOR_TOKENS: float(self.tokens),
            mn.ACTOR_FORWARD_PASSES: float(self.full_forwards),
            mn.ACTOR_GEN_TIME_S: gen_time_s,
            mn.ACTOR_TOKENS_PER_S: self.tokens / gen_time_s if gen_time_s else 0.0,
            mn.SPEC_FORWARDS_PER_TOKEN: self.full_forwards / self.tokens if self.tokens else 0.0,
        }
        if speculative:
            out.update(self._spec_report())
        if self.swaps:
            out.update(self._swap_report())
        return out

    def _spec_report(self) -> dict[str, float]:
        out = {
            mn.SPEC_ACCEPTANCE_RATE: self.accepted / self.proposed if self.proposed else 0.0,
            # Tokens emitted per verification: accepted drafts + the one sampled token.
            mn.SPEC_MEAN_ACCEPTED_LEN: (
                (self.accepted + self.verify_steps) / self.verify_steps
                if self.verify_steps
                else 0.0
            ),
            mn.SPEC_DRAFT_LAYER_PASSES_PER_TOKEN: (
                self.draft_layer_passes / self.tokens if self.tokens else 0.0
            ),
        }
        for i, (p, a) in enumerate(zip(self.proposed_at, self.accepted_at, strict=True)):
            out[f"{mn.SPEC_ACCEPTANCE_POS_PREFIX}{i + 1}"] = a / p if p else 0.0
        # Tokens per forward that verified drafts, all rows of the step together.
        out[mn.SPEC_TOKENS_PER_VERIFY_FORWARD] = (
            self.spec_tokens / self.spec_forwards if self.spec_forwards else 0.0
        )
        if self.draft_version is not None:
            out[mn.SPEC_DRAFT_VERSION] = float(self.draft_version)
        steps = sum(self.chosen_k)
        if steps:
            for k, n in enumerate(self.chosen_k):
                out[f"{mn.SPEC_DRAFT_LEN_PREFIX}k{k}"] = n / steps
            out[mn.SPEC_MEAN_DRAFT_LEN] = sum(k * n for k, n in enumerate(self.chosen_k)) / steps
            for kind, n in self.chosen_kind.items():
                out[f"{mn.SPEC_DRAFTER_PREFIX}{kind}"] = n / steps
        return out

    def _swap_report(self) -> dict[str, float]:
        out = {
            mn.VERIFY_SWAPS: float(self.swaps),
            mn.VERIFY_INFLIGHT_TOKENS: float(self.inflight_tokens),
            mn.VERIFY_SALVAGED_TOKENS: float(self.salvaged_tokens),
            mn.VERIFY_WASTED_TOKENS: float(self.wasted_tokens),
            mn.VERIFY_FORWARD_TOKENS: float(self.verify_forward_tokens),
            # Share of the tokens in flight at swaps that survived (abort: 0; keep: not checked).
            mn.VERIFY_SALVAGED_FRAC: (
                self.salvaged_tokens / self.inflight_tokens if self.inflight_tokens else 1.0
            ),
        }
        for gap, proposed in sorted(self.gap_proposed.items()):
            out[f"{mn.VERIFY_ACCEPTANCE_GAP_PREFIX}{gap}"] = (
                self.gap_accepted.get(gap, 0) / proposed
            )
        return out


class Batch:
    """The batch state of the torch engine: the paged KV cache of its rows, the counters behind
    ``stats``, and the call in progress with the time it started (``live``)."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.counters = Counters()
        self.live: tuple[float, Call] | None = None

    @contextmanager
    def running(self, call: Call, started: float) -> Iterator[None]:
        """``call`` in progress since ``started`` (``perf_counter()``); afterwards (also when it
        raised) no row of it keeps blocks, and its time less its callbacks' counts as
        generating."""
        self.live = (started, call)
        try:
            yield
        finally:
            for row in (*call.rows, *call.live.values()):
                self.cache.release(row.id)
            self.live = None
            self.counters.gen_time_s += time.perf_counter() - started - call.callback_s

    def bind(self, rows: Sequence[Row], ahead: Sequence[int]) -> PagedKVCache:
        """Blocks for every row's pending token and ``ahead[i]`` slots after it; binds them."""
        for row, extra in zip(rows, ahead, strict=True):
            self.cache.reserve(row.id, row.pos + 1 + extra)
        return self.cache.bind([r.id for r in rows])

    def report(self, speculative: bool, reset: bool) -> dict[str, float]:
        """The counters' figures, the call in progress's time so far included; ``reset``: start
        counting afresh."""
        gen_time_s = self.counters.gen_time_s
        if self.live is not None:
            started, call = self.live
            gen_time_s += time.perf_counter() - started - call.callback_s
        out = self.counters.report(gen_time_s, speculative)
        if reset:
            self.counters = Counters()
        return out

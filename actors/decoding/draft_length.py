"""Adaptive draft length (``spec.adaptive``): each decoding step of the torch engine picks its
draft length k in [0, spec.k] (0 = a plain step) and, for ``hybrid``, its drafter, by expected
tokens per unit of measured cost. The drafters: n-gram matches, the early exit, the policy's
EAGLE-3 head (``eagle3``: drafts k tokens for every row, as the early exit does).

Decision rule, per step, at the current number of rows B:

- **Expected tokens.** A plain step emits B tokens. A row drafting k tokens emits
  ``1 + sum_{i<k} P(its first i + 1 drafts are accepted)``, the running products of the
  *conditional* acceptance by draft position (draft i accepted, given that those before it
  were), measured per drafter and exponentially decayed (by ``decay`` per decoding step),
  so they follow a policy that changes. A position never measured takes the conditional
  acceptance of the last measured one (a position measured little is shrunk towards it).
  n-gram drafts exist only where a row's context has a match, so an n-gram row drafts
  ``min(k, its match length)`` tokens: the match lengths are looked up before the step (they
  depend on the tokens so far only), and n-gram acceptance is measured per proposed position.
  ``hybrid``'s early-exit steps draft a row's n-gram match first (those positions count as
  n-gram positions) and the early exit after it, where that is expected to bring more tokens
  than the early exit alone.
- **Cost.** The wall time of each step (the engine's clock around it; a step ends in a host
  sync), per (plain | drafter, k, rows bucketed into powers of two), in units of the machine's
  current speed: a step's deviation from its estimate moves a common speed level at once and
  its own estimate by a share that falls as it gathers measurements (but is high again for
  one not measured for a while), so a load that comes and goes (other processes, the learner
  next door) does not make a choice measured now and then (a probe) look cheaper or dearer
  than the usual one; a deviation counts as 0.5x to 1.5x at most, and a first measurement as
  3x what the bucket's other measurements predict at most. An unmeasured k is interpolated
  linearly between the measured ones of its drafter and bucket (a plain step is k = 0),
  beyond the largest one extended by the mean slope; a drafter not measured in this bucket is
  scaled from the nearest bucket that measured it (relative to that bucket's plain step);
  before anything is measured a prior stands in (a verify forward 10% dearer per draft token,
  each early-exit pass, k + 1 a step, or each EAGLE-3 head pass, k a step, ``draft_cost`` of a
  plain step).
- **Choice.** The argmax of expected tokens / cost over plain and every (drafter, k <= spec.k)
  (an n-gram k no longer than the longest match of the step), where drafting must beat a
  plain step by ``MARGIN`` (3%): timing noise alone does not make it win. A decision stands
  for ``REDECIDE_STEPS`` steps in the same rows bucket (an n-gram step no longer than the
  step's longest match). Now and then a neighbour of the choice is probed instead (plain,
  k - 1, k + 1, the other drafter at k): one never measured at this bucket as soon as it is
  affordable, else every ``explore_every`` steps the one measured longest ago. A probe is
  affordable while the estimated loss of all probes so far (in steps of the best choice)
  stays within ``explore_budget`` of the steps taken, so exploration costs about
  ``explore_budget`` of the throughput.

Exactness: a step's choice depends only on the past (the tokens so far through the n-gram
match lengths, earlier steps' wall times and acceptance), never on the current step's random
draws. Speculative sampling emits an exact sample of the target distribution for any drafts
fixed before its uniforms are drawn (docs/design.md §2.2), so it stays exact whatever is
chosen, step after step.

The decision is a pure function of the recorded statistics and the clock is injected
(``clock``), so tests drive the controller deterministically (tests/unit/actors).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

PLAIN, NGRAM, EARLY_EXIT, EAGLE = "plain", "ngram", "early_exit", "eagle3"
DRAFTERS = {
    "ngram": (NGRAM,),
    "early_exit": (EARLY_EXIT,),
    "hybrid": (NGRAM, EARLY_EXIT),
    "eagle3": (EAGLE,),
}
"""The drafters of each ``spec.method`` that drafts."""
MODEL_DRAFTERS = (EARLY_EXIT, EAGLE)
"""Drafters that run a network for every row (each row drafts k tokens): the early exit and the
EAGLE-3 head; a method has at most one of them."""

VERIFY_SLOPE = 0.1
"""Prior: a verify forward's cost grows by this share of a plain step per draft token."""

LEVEL_GAIN = 0.3
"""Share of a step's deviation from its estimate (in log space) taken as a change in the
machine's speed (a load that comes and goes: other processes, the learner next door)."""
COST_GAIN_MIN, STALE_STEPS = 0.03, 32
"""The share of a deviation that goes into the step's own estimate: 1/2 at first, falling as
the estimate gathers measurements to COST_GAIN_MIN, but ``age / STALE_STEPS`` (up to 1/2)
for an estimate last measured ``age`` steps ago."""
DEVIATION = (math.log(0.5), math.log(1.5))
"""A deviation counts as at most this (log space): a hiccup is not the machine's speed."""
MARGIN = 0.03
"""Drafting must promise this much more throughput than a plain step to be chosen."""
REDECIDE_STEPS = 4
"""A decision stands for this many steps (in the same rows bucket), unless a probe is due."""


@dataclass(frozen=True)
class Choice:
    """One step's decision: ``kind`` plain or a drafter, ``k`` draft tokens per row (an n-gram
    row drafts at most its match length); a plain step has k = 0. ``ngram_prefix`` (hybrid's
    early-exit steps): each row's n-gram match is drafted first, the early exit after it."""

    kind: str
    k: int
    ngram_prefix: bool = False


PLAIN_STEP = Choice(PLAIN, 0)


@dataclass(frozen=True)
class StepOutcome:
    """A step taken, as the controller learns from it: its ``choice``, its ``rows``, its wall
    time and, when it verified drafts, per row the drafts ``accepted`` and ``proposed`` and
    (hybrid's early-exit steps) how many leading drafts were the row's n-gram match
    (``forced``)."""

    choice: Choice
    rows: int
    seconds: float
    accepted: Sequence[int] | None = None
    proposed: Sequence[int] | None = None
    forced: Sequence[int] | None = None


class Option(NamedTuple):
    """A candidate step: its choice, expected tokens (all rows) and estimated seconds."""

    choice: Choice
    tokens: float
    seconds: float

    @property
    def score(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def rows_bucket(rows: int) -> int:
    """Rows bucketed into powers of two: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, 9-16 -> 4, ..."""
    return max(0, rows - 1).bit_length()


# ------------------------------------------------------------------------------ acceptance


class Acceptance:
    """One drafter's conditional acceptance by draft position, exponentially decayed."""

    def __init__(self, k_max: int, prior: float, weight: float, decay: float) -> None:
        self.reached = [0.0] * k_max  # rows that reached position i: drafts before it accepted
        self.accepted = [0.0] * k_max  # ... whose draft i was accepted too
        self.prior, self.weight, self.decay = prior, weight, decay
        self.step = 0  # the decoding step the counts are decayed to
        self._estimates: tuple[list[float], list[float]] | None = None

    def advance(self, step: int) -> None:
        """Decay the counts to ``step``: by ``decay`` per decoding step, measured or not, so a
        drafter measured only now and then weighs its latest measurements most (and one not
        measured for long drifts back towards the prior)."""
        if step > self.step:
            factor = self.decay ** (step - self.step)
            self.reached = [r * factor for r in self.reached]
            self.accepted = [a * factor for a in self.accepted]
            self.step = step
            self._estimates = None

    def add(self, reached: Sequence[float], accepted: Sequence[float], step: int) -> None:
        """The counts per position of decoding step ``step``."""
        self.advance(step)
        for i, (r, a) in enumerate(zip(reached, accepted, strict=True)):
            self.reached[i] += r
            self.accepted[i] += a
        self._estimates = None

    def conditional(self) -> list[float]:
        """P(draft i accepted | drafts before it accepted) per position. A position measured
        little (or never) is shrunk towards (or takes) the estimate of the position before it;
        position 0 towards ``prior``."""
        return self._estimate()[0]

    def cumulative(self) -> list[float]:
        """P(the first i + 1 drafts are all accepted), i = 0 .. k_max - 1."""
        return self._estimate()[1]

    def _estimate(self) -> tuple[list[float], list[float]]:
        if self._estimates is None:
            conditional, cumulative = [], []
            previous, p = self.prior, 1.0
            for reached, accepted in zip(self.reached, self.accepted, strict=True):
                previous = (accepted + self.weight * previous) / (reached + self.weight)
                p *= previous
                conditional.append(previous)
                cumulative.append(p)
            self._estimates = conditional, cumulative
        return self._estimates


# ------------------------------------------------------------------------------ costs


class StepCosts:
    """Seconds of a step by (kind, k, rows bucket): measured ones, estimates for the rest."""

    def __init__(self, k_max: int, drafters: Sequence[str], draft_cost: float) -> None:
        self.k_max, self.drafters, self.draft_cost = k_max, tuple(drafters), draft_cost
        self.level = 0.0  # log of the machine's speed: recent step times over estimates
        self.counts: dict[tuple[str, int, int], int] = {}  # measurements per (kind, k, bucket)
        self.measured: dict[int, dict[tuple[str, int], float]] = {}  # bucket -> (kind, k) -> s
        self.last: dict[tuple[str, int, int], int] = {}  # (kind, k, bucket) -> step measured
        self._tables: dict[int, dict[str, list[float]]] = {}

    def prior_ratio(self, kind: str, k: int) -> float:
        """Prior cost of a step relative to a plain one."""
        if kind == PLAIN:
            return 1.0
        ratio = 1.0 + VERIFY_SLOPE * k
        if kind == EARLY_EXIT:
            return ratio + self.draft_cost * (k + 1)
        return ratio + self.draft_cost * k if kind == EAGLE else ratio

    def record(self, kind: str, k: int, bucket: int, seconds: float, step: int) -> None:
        """One step's wall time, at decision ``step``. Estimates are in units of the machine's
        speed (``level``), which a deviation of any step moves at once, while the step's own
        estimate moves by a share that falls as it gathers measurements: a load that comes
        and goes shows in ``level``, so a choice measured now and then (a probe) is compared
        with the usual one at the same load."""
        here = self.measured.setdefault(bucket, {})
        key = (kind, k)
        old = here.get(key)
        if old is None:
            new = seconds / math.exp(self.level)
            if here:
                # A first measurement (new shapes: allocations, kernel selection) is capped at
                # 3x what this bucket's other measurements predict.
                new = min(new, 3.0 * self.table(bucket)[kind][k])
            self.counts[(kind, k, bucket)] = 1
        else:
            low, high = DEVIATION
            deviation = min(max(math.log(seconds / old) - self.level, low), high)
            n = self.counts[(kind, k, bucket)]
            # An estimate not measured for a while (a probe's) is uncertain: its own gain is
            # high, and the deviation says little about the machine's speed.
            age = step - self.last[(kind, k, bucket)]
            gain = min(max(1.0 / (n + 1), age / STALE_STEPS, COST_GAIN_MIN), 0.5)
            new = old * math.exp(gain * deviation)
            self.level += LEVEL_GAIN * (1 - gain) * deviation
            self.counts[(kind, k, bucket)] = n + 1
        here[key] = new
        self.last[(kind, k, bucket)] = step
        self._tables.clear()

    def table(self, bucket: int) -> dict[str, list[float]]:
        """Estimated seconds at ``bucket``: {kind: [k = 0 .. k_max]} (plain: [k = 0])."""
        table = self._tables.get(bucket)
        if table is None:
            plain = self._plain(bucket)
            table = {kind: self._curve(kind, bucket, plain) for kind in self.drafters}
            table[PLAIN] = [plain]
            self._tables[bucket] = table
        return table

    def _nearest(self, bucket: int) -> list[int]:
        """The other measured buckets, nearest first."""
        return sorted((b for b in self.measured if b != bucket), key=lambda b: (abs(b - bucket), b))

    def _plain(self, bucket: int) -> float:
        here = self.measured.get(bucket)
        if not here:
            nearest = self._nearest(bucket)
            # Nothing here: the nearest bucket's figures (only ratios matter within a bucket).
            return self._plain(nearest[0]) if nearest else 1.0
        if (PLAIN, 0) in here:
            return here[(PLAIN, 0)]
        for other in self._nearest(bucket):
            there = self.measured[other]
            if (PLAIN, 0) in there:
                for key, seconds in here.items():
                    if key in there:
                        return seconds * there[(PLAIN, 0)] / there[key]
        kind, k = min(here, key=lambda key: (key[1], key[0]))
        return here[(kind, k)] / self.prior_ratio(kind, k)

    def _curve(self, kind: str, bucket: int, plain: float) -> list[float]:
        here = self.measured.get(bucket, {})
        points = sorted((k, s) for (what, k), s in here.items() if what == kind)
        if not points:
            for other in self._nearest(bucket):
                if any(what == kind for what, _ in self.measured[other]):
                    their_plain = self._plain(other)
                    scale = plain / their_plain
                    return [s * scale for s in self._curve(kind, other, their_plain)]
            return [plain * self.prior_ratio(kind, k) for k in range(self.k_max + 1)]
        xs = [0] + [k for k, _ in points]
        ys = [plain] + [s for _, s in points]
        slope = max(0.0, (ys[-1] - ys[0]) / xs[-1])
        out, j = [plain], 0
        for k in range(1, self.k_max + 1):
            while j + 1 < len(xs) and xs[j + 1] < k:
                j += 1
            if j + 1 < len(xs):  # xs[j] < k <= xs[j + 1]
                x0, x1, y0, y1 = xs[j], xs[j + 1], ys[j], ys[j + 1]
                out.append(y0 + (y1 - y0) * (k - x0) / (x1 - x0))
            else:
                out.append(ys[-1] + slope * (k - xs[-1]))
        return out


# ------------------------------------------------------------------------------ controller


class DraftLength:
    """Picks each decoding step's drafter and draft length (see the module docstring).

    ``method``: ``ngram``, ``early_exit``, ``hybrid`` or ``eagle3``; ``k_max``: ``spec.k``;
    ``draft_cost``: prior cost of one draft pass (early exit or EAGLE-3 head) relative to a plain
    step (its share of the layers);
    ``clock``: seconds, for the engine to time steps with (a :class:`StepOutcome` brings the
    duration back to :meth:`learn`).
    """

    adaptive = True

    def __init__(
        self,
        method: str,
        k_max: int,
        draft_cost: float = 0.25,
        clock: Callable[[], float] = time.perf_counter,
        explore_every: int = 16,
        explore_budget: float = 0.01,
        decay: float = 0.98,
        prior: float = 0.5,
    ) -> None:
        if method not in DRAFTERS:
            raise ValueError(f"adaptive draft length needs a drafter, got method {method!r}")
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        self.method, self.k_max, self.clock = method, k_max, clock
        self.drafters = DRAFTERS[method]
        # The drafter whose positions are not n-gram ones (None for ``ngram``).
        self.model_drafter = next((d for d in self.drafters if d in MODEL_DRAFTERS), None)
        self.explore_every, self.explore_budget = explore_every, explore_budget
        # n-gram acceptance is also measured in hybrid's early-exit steps (the n-gram prefix).
        self.acceptance = {d: Acceptance(k_max, prior, 2.0, decay) for d in self.drafters}
        self.costs = StepCosts(k_max, self.drafters, draft_cost)
        self.steps = 0  # decisions so far
        self.probes = 0  # of which probes
        self._last_probe = 0
        self._probe_loss = 0.0  # estimated loss of the probes, in steps of the best choice
        self._kept: tuple[Choice, int, int] | None = None  # last decision: choice, bucket, step
        self._choices = {
            (kind, k, prefix): Choice(kind, k, prefix)
            for kind in (NGRAM, *MODEL_DRAFTERS)
            for k in range(1, k_max + 1)
            for prefix in (False, True)
        }

    # ---------------------------------------------------------------- decision

    def choose(
        self, rows: int, matches: Sequence[int] | Callable[[], Sequence[int]] | None = None
    ) -> Choice:
        """The next step's choice for ``rows`` rows. ``matches``: each row's n-gram match length
        (drafts available, up to ``k_max``), or a callable that looks them up, called only when
        an n-gram step could win or be probed (method ``ngram``); None: no n-gram drafts."""
        self.steps += 1
        bucket = rows_bucket(rows)
        affordable = self._probe_loss <= self.explore_budget * self.steps
        timely = self.steps - self._last_probe >= self.explore_every
        kept = self._kept
        if (
            kept is not None
            and self.steps - kept[2] < REDECIDE_STEPS
            and kept[1] == bucket
            and not (affordable and timely)
        ):
            return self._keep(kept[0], matches)
        if callable(matches):
            may_probe = affordable and timely
            matches = matches() if may_probe or self._ngram_may_win(bucket) else None
        options = self.options(rows, matches)
        # Drafting must beat a plain step by MARGIN: timing noise alone never makes it win.
        best = max(options, key=lambda o: o.score * (1 + MARGIN if o.choice == PLAIN_STEP else 1))
        self._kept = (best.choice, bucket, self.steps)
        if affordable and self._measured(best.choice, bucket):
            probe = self._probe(best, options, bucket, timely)
            if probe is not None:
                return probe
        return best.choice

    def _keep(
        self, choice: Choice, matches: Sequence[int] | Callable[[], Sequence[int]] | None
    ) -> Choice:
        """The last decision again (decisions are made every REDECIDE_STEPS steps); an n-gram
        step drafts no further than this step's longest match."""
        if choice.kind != NGRAM:
            return choice
        lengths = matches() if callable(matches) else matches
        longest = max(lengths, default=0) if lengths is not None else 0
        if longest >= choice.k:
            return choice
        return self._choices[(NGRAM, longest, False)] if longest > 0 else PLAIN_STEP

    def options(self, rows: int, matches: Sequence[int] | None = None) -> list[Option]:
        """Every candidate step with its expected tokens and estimated seconds (plain first)."""
        for acceptance in self.acceptance.values():
            acceptance.advance(self.steps)
        costs = self.costs.table(rows_bucket(rows))
        out = [Option(PLAIN_STEP, float(rows), costs[PLAIN][0])]
        lengths = None if matches is None else list(matches)
        if lengths and max(lengths) > self.k_max:
            lengths = [min(m, self.k_max) for m in lengths]
        if NGRAM in self.drafters and lengths:
            out += self._ngram_options(rows, lengths, costs[NGRAM])
        kind = self.model_drafter
        if kind is not None:
            out += self._model_options(kind, rows, lengths, costs[kind])
        return out

    def _ngram_options(self, rows: int, lengths: list[int], costs: list[float]) -> list[Option]:
        longest = max(lengths)
        at_least = [0] * (longest + 1)  # at_least[n]: rows whose match has n tokens or more
        for m in lengths:
            at_least[m] += 1
        for n in range(longest - 1, -1, -1):
            at_least[n] += at_least[n + 1]
        reach = self.acceptance[NGRAM].cumulative()
        tokens, out = float(rows), []
        for k in range(1, longest + 1):
            # Rows with a draft at position k - 1: matches of k tokens or more.
            tokens += at_least[k] * reach[k - 1]
            out.append(Option(self._choices[(NGRAM, k, False)], tokens, costs[k]))
        return out

    def _model_options(
        self, kind: str, rows: int, lengths: list[int] | None, costs: list[float]
    ) -> list[Option]:
        """Drafts of ``kind`` (early exit or EAGLE-3 head) for every row; the early exit's after
        each row's n-gram match where that is expected to bring more (the same cost either
        way)."""
        exit_ = self.acceptance[kind].conditional()
        alone = self._gains({0: rows}, exit_, exit_)
        prefixed = None
        if NGRAM in self.acceptance and lengths and any(lengths):
            prefixed = self._gains(Counter(lengths), self.acceptance[NGRAM].conditional(), exit_)
        tokens, with_prefix, out = float(rows), float(rows), []
        for k in range(1, self.k_max + 1):
            tokens += alone[k - 1]
            if prefixed is not None:
                with_prefix += prefixed[k - 1]
            if prefixed is not None and with_prefix > tokens:
                choice = self._choices[(kind, k, True)]
                out.append(Option(choice, with_prefix, costs[k]))
            else:
                out.append(Option(self._choices[(kind, k, False)], tokens, costs[k]))
        return out

    def _gains(
        self, prefixes: Mapping[int, int], ngram: list[float], exit_: list[float]
    ) -> list[float]:
        """Expected accepted drafts at each position, over rows grouped by the length of their
        n-gram prefix (``prefixes``: length -> rows)."""
        gain = [0.0] * self.k_max
        for m, count in prefixes.items():
            p = 1.0
            for i in range(self.k_max):
                p *= ngram[i] if i < m else exit_[i]
                gain[i] += count * p
        return gain

    def _ngram_may_win(self, bucket: int) -> bool:
        """Whether an n-gram step could beat a plain one even if every row matched fully."""
        costs = self.costs.table(bucket)
        reach = self.acceptance[NGRAM].cumulative()
        plain = 1.0 / costs[PLAIN][0]
        tokens = 1.0
        for k in range(1, self.k_max + 1):
            tokens += reach[k - 1]
            if tokens / costs[NGRAM][k] > plain:
                return True
        return False

    def _measured(self, choice: Choice, bucket: int) -> bool:
        return (choice.kind, choice.k, bucket) in self.costs.last

    def _probe(
        self, best: Option, options: list[Option], bucket: int, timely: bool
    ) -> Choice | None:
        """A neighbour of ``best`` (plain, k - 1, k + 1, the other drafter at k) to measure
        instead: the first never measured at this bucket, else (``timely``) the one measured
        longest ago. Its estimated loss, in steps of ``best``, is charged to the budget."""
        kind, k = best.choice.kind, best.choice.k
        if kind == PLAIN:
            near = [(d, 1) for d in self.drafters]
        else:
            # Plain first: the baseline every verify cost is extrapolated from.
            other = [(d, k) for d in self.drafters if d != kind]
            steps = [(kind, k - 1), (kind, k + 1), *other]
            near = [(PLAIN, 0), *(s for s in steps if 1 <= s[1] <= self.k_max)]
        last = self.costs.last
        fresh = [step for step in near if (*step, bucket) not in last]
        if not fresh and not timely:
            return None
        by_step = {(o.choice.kind, o.choice.k): o for o in options}
        if any(step in by_step for step in fresh):
            probe = next(by_step[step] for step in fresh if step in by_step)
        elif timely:
            self._last_probe = self.steps
            candidates = [by_step[step] for step in near if step in by_step]
            if not candidates:
                return None
            probe = min(candidates, key=lambda o: last[(o.choice.kind, o.choice.k, bucket)])
        else:
            return None
        self._probe_loss += probe.seconds / best.seconds * max(0.0, 1 - probe.score / best.score)
        self.probes += 1
        return probe.choice

    # ---------------------------------------------------------------- measurements

    def learn(self, step: StepOutcome) -> None:
        """A step taken: its wall time and, when it verified drafts, its acceptance."""
        choice, seconds = step.choice, max(step.seconds, 1e-9)
        self.costs.record(choice.kind, choice.k, rows_bucket(step.rows), seconds, self.steps)
        if choice.kind != PLAIN and step.accepted is not None and step.proposed is not None:
            # An n-gram step's every position is an n-gram one.
            forced = step.proposed if choice.kind == NGRAM else step.forced
            self._observe(step.accepted, step.proposed, forced or [0] * len(step.proposed))

    def record(
        self,
        choice: Choice,
        rows: int,
        seconds: float,
        accepted: Sequence[int] | None = None,
        proposed: Sequence[int] | None = None,
        forced: Sequence[int] | None = None,
    ) -> None:
        """:meth:`learn` from the fields of a :class:`StepOutcome`."""
        self.learn(StepOutcome(choice, rows, seconds, accepted, proposed, forced))

    def _observe(
        self, accepted: Sequence[int], proposed: Sequence[int], forced: Sequence[int]
    ) -> None:
        """Per-position counts of one step, split into n-gram positions (the first ``forced``
        of a row) and the model drafter's (early exit or EAGLE-3 head), through difference
        arrays over the distinct rows."""
        size = self.k_max + 1
        ngram_reached, ngram_accepted = [0] * size, [0] * size
        exit_reached, exit_accepted = [0] * size, [0] * size
        for (a, p, f), n in Counter(zip(accepted, proposed, forced, strict=True)).items():
            p = min(p, self.k_max)
            a, f = min(a, p), min(f, p)
            r = a + 1 if a < p else p  # positions reached: the accepted ones and a rejection
            for diff, start, stop in (
                (ngram_reached, 0, min(f, r)),
                (ngram_accepted, 0, min(f, a)),
                (exit_reached, f, r),
                (exit_accepted, f, a),
            ):
                if stop > start:
                    diff[start] += n
                    diff[stop] -= n
        for drafter, reached, acc in (
            (NGRAM, ngram_reached, ngram_accepted),
            (self.model_drafter, exit_reached, exit_accepted),
        ):
            if any(reached) and drafter in self.acceptance:
                self.acceptance[drafter].add(_prefix_sums(reached), _prefix_sums(acc), self.steps)


def _prefix_sums(diff: list[int]) -> list[int]:
    out, total = [], 0
    for d in diff[:-1]:
        total += d
        out.append(total)
    return out

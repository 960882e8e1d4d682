"""Decoding steps of the torch engine: plain sampling, or drafts (early exit, n-gram, both, or
the EAGLE-3 head: :mod:`actors.engines.torch.eagle`) verified by the full model, for every row
of the batch at once. Rows have their own positions; the cache is written at each row's
position before it is attended to (see :mod:`common.model`), so every row accepts its own
number of tokens per step."""

from __future__ import annotations

import torch

from actors.decoding.draft_length import EAGLE, EARLY_EXIT, NGRAM, PLAIN, DraftLength, StepOutcome
from actors.decoding.eagle import EagleDrafter
from actors.decoding.early_exit import EarlyExitDrafter
from actors.decoding.fixed_length import FixedLength
from actors.decoding.ngram import NgramDrafter
from actors.decoding.paged_cache import PagedKVCache
from actors.decoding.sampler import pad_rows, rejection_sample
from actors.engines.torch.eagle import EagleSteps, concat_aux
from actors.engines.torch.rows import Batch, Emitted, Policy, Row, Sampling
from common.config.actor import SpecConfig
from common.sampling import processed_logprobs, sample_tokens


class Decoder:
    """The torch engine's decoding: each step of the rows in the batch with ``policy``'s model
    over ``batch``'s cache, drafting with the drafters given (the EAGLE-3 head's steps:
    :class:`~actors.engines.torch.eagle.EagleSteps`). One dispatcher: each step's drafter and k
    come from ``draft_length`` (``spec.adaptive``), else from a :class:`FixedLength` (``spec.k``
    with the drafters present)."""

    def __init__(
        self,
        policy: Policy,
        batch: Batch,
        sampling: Sampling,
        spec: SpecConfig,
        *,
        pad_id: int,
        device: torch.device,
        early_exit: EarlyExitDrafter | None = None,
        ngram: NgramDrafter | None = None,
        eagle: EagleDrafter | None = None,
        draft_length: DraftLength | None = None,
    ) -> None:
        self.policy, self.batch, self.sampling, self.spec = policy, batch, sampling, spec
        self.pad_id, self.device = pad_id, device
        self.early_exit, self.ngram = early_exit, ngram
        self.control: DraftLength | FixedLength = draft_length or FixedLength(
            spec.k,
            early_exit=early_exit is not None,
            ngram=ngram is not None,
            eagle=eagle is not None,
        )
        self.eagle_steps = (
            EagleSteps(eagle, policy, batch, sampling, pad_id, device)
            if eagle is not None
            else None
        )

    def prefill(self, rows: list[Row], sequences: list[list[int]], aux: list | None = None) -> int:
        """Run the current weights over each row's ``sequence`` from position 0, writing its
        cache (no LM head: nothing is sampled); returns the tokens pushed through. ``aux``:
        appended with the forward's auxiliary states (``Transformer.run_layers``)."""
        width = max(len(s) for s in sequences)
        if width == 0:
            return 0
        model = self.policy.model
        ids = pad_rows(sequences, width, self.pad_id, self.device)
        positions = torch.arange(width, device=self.device).expand(len(rows), -1)
        cache = self.batch.cache.bind([r.id for r in rows])
        x = model.model.embed_tokens(ids)
        model.run_layers(x, positions, cache, 0, model.args.num_hidden_layers, aux=aux)
        return ids.numel()

    def step(self, active: list[Row]) -> list[tuple[list[int], list[float]]]:
        """One decoding step of every row of the batch: per row (tokens, logprobs) emitted."""
        emitted = self._step(active)
        if emitted.accepted is not None and emitted.proposed is not None:
            self.batch.counters.count_drafts(emitted.accepted, emitted.proposed)
        return emitted.rows

    def _step(self, active: list[Row]) -> Emitted:
        if active[0].prefix or any(r.prefix for r in active):
            return self._first_step(active)
        last = torch.tensor([r.last for r in active], dtype=torch.long, device=self.device)
        pos = torch.tensor([r.pos for r in active], dtype=torch.long, device=self.device)
        return self._draft_step(active, last, pos, self.control)

    def _draft_step(
        self,
        active: list[Row],
        last: torch.Tensor,
        pos: torch.Tensor,
        control: DraftLength | FixedLength,
    ) -> Emitted:
        """A step whose drafter and draft length ``control`` picks from the past only (n-gram
        matches of the tokens so far, earlier steps' times and acceptance: exact whatever it
        picks); an adaptive controller gets the step's outcome (wall time, acceptance) back."""
        ids = [r.id for r in active]
        drafts: list[list[int]] = []
        ngram = self.ngram

        def match_lengths() -> list[int]:
            assert ngram is not None
            drafts[:] = ngram.propose_rows(ids, self.spec.k)
            return [len(d) for d in drafts]

        matches = None
        if ngram is not None:
            # Hybrid's early-exit steps draft the matches first: look them up every step.
            matches = match_lengths() if self.early_exit is not None else match_lengths
        choice = control.choose(len(active), matches)
        k, forced, started = choice.k, None, 0.0
        if control.adaptive:
            self.batch.counters.count_choice(choice.kind, choice.k, self.spec.k, self.spec.method)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # newcomers' prefill is not this step's time
            started = control.clock()
        if self.eagle_steps is not None:
            assert choice.kind in (PLAIN, EAGLE)
            emitted = self.eagle_steps.step(active, last, pos, k)
        elif choice.kind == PLAIN:
            emitted = self._plain_step(self.batch.bind(active, [0] * len(active)), last, pos)
        elif choice.kind == NGRAM:
            emitted = self._verify_ngram(active, [d[:k] for d in drafts], last, pos)
        else:
            assert choice.kind == EARLY_EXIT
            forced = [d[:k] for d in drafts] if choice.ngram_prefix else None
            cache = self.batch.bind(active, [k] * len(active))
            emitted = self._early_exit_step(cache, last, pos, forced, k)
        if control.adaptive:
            seconds = control.clock() - started
            lengths = None if forced is None else [len(f) for f in forced]
            outcome = StepOutcome(
                choice, len(active), seconds, emitted.accepted, emitted.proposed, lengths
            )
            control.learn(outcome)
        return emitted

    def _first_step(self, active: list[Row]) -> Emitted:
        """Newcomers' first step, prompts included: each row's prompt, then its n-gram drafts
        (copied from earlier completions of the prompt), through one forward that writes the
        cache and scores the start of the completion, so a prompt answered before can be
        answered again in one pass. Rows with the same prompt and drafts (a GRPO group) share
        one row of that forward and copy its cache."""
        model, sampling, cache = self.policy.model, self.sampling, self.batch.cache
        drafts: list[list[int]] = [[] for _ in active]
        if self.ngram is not None:
            drafts = self.ngram.propose_rows([r.id for r in active], self.spec.k)
        seqs = [(*r.prefix, r.last, *d) for r, d in zip(active, drafts, strict=True)]
        first: dict[tuple[int, ...], int] = {}
        for j, seq in enumerate(seqs):
            first.setdefault(seq, j)
        unique = list(first)
        slot = {seq: i for i, seq in enumerate(unique)}
        for row, seq in zip(active, seqs, strict=True):
            cache.reserve(row.id, len(seq))
        width = max(len(seq) for seq in unique)
        ids = pad_rows(unique, width, self.pad_id, self.device)
        positions = torch.arange(width, device=self.device).expand(len(unique), -1)
        bound = cache.bind([active[first[seq]].id for seq in unique])
        taps: list[torch.Tensor] | None = [] if self.eagle_steps is not None else None
        x = model.model.embed_tokens(ids)
        layers = model.args.num_hidden_layers
        hidden = model.model.norm(model.run_layers(x, positions, bound, 0, layers, taps))
        self.batch.counters.full_forwards += 1
        cache.copy_prefix(
            [
                (active[first[seq]].id, row.id, len(seq))
                for j, (row, seq) in enumerate(zip(active, seqs, strict=True))
                if first[seq] != j
            ]
        )
        inverse = torch.tensor([slot[seq] for seq in seqs], device=self.device)  # [B]
        if taps is not None:  # the head's states of the prompt and the pending token
            states = concat_aux(model, taps)[inverse]  # [B, W, n_aux * H]
            for row, row_states in zip(active, states, strict=True):
                row.head_pos, row.head_aux = 0, [row_states[: len(row.prefix) + 1]]
        kmax = max(len(d) for d in drafts)
        start = torch.tensor([len(r.prefix) for r in active], device=self.device)
        # Scores of the first completion token and of each draft: offsets len(prefix) + 0..K.
        at = (start[:, None] + torch.arange(kmax + 1, device=self.device)).clamp(max=width - 1)
        # The LM head only where scores are read, not over every prompt position.
        logits = model.lm_head(hidden[inverse[:, None], at]).float()  # [B, K+1, V]
        target = processed_logprobs(logits, sampling.temperature, sampling.top_p)
        for row in active:
            row.prefix = []
        if kmax == 0:
            return Emitted.sampled(*sample_tokens(target[:, 0], sampling.generator))
        draft_tokens, num_drafts = self._pad_drafts(drafts, kmax)
        result = rejection_sample(
            target, draft_tokens, None, num_drafts, generator=sampling.generator
        )
        return Emitted.verified(result, num_drafts)

    def _pad_drafts(self, drafts: list[list[int]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts as [B, K] (padded) and their lengths [B]."""
        draft_tokens = pad_rows(drafts, k, self.pad_id, self.device)
        return draft_tokens, torch.tensor([len(d) for d in drafts], device=self.device)

    def _plain_step(self, cache: PagedKVCache, last: torch.Tensor, pos: torch.Tensor) -> Emitted:
        sampling = self.sampling
        logits = self.policy.model(last[:, None], pos[:, None], cache)[:, 0]  # [B, V] fp32
        self.batch.counters.full_forwards += 1
        target = processed_logprobs(logits, sampling.temperature, sampling.top_p)
        return Emitted.sampled(*sample_tokens(target, sampling.generator))

    def _early_exit_step(
        self,
        cache: PagedKVCache,
        last: torch.Tensor,
        pos: torch.Tensor,
        forced: list[list[int]] | None = None,
        k: int | None = None,
    ) -> Emitted:
        early_exit, sampling = self.early_exit, self.sampling
        assert early_exit is not None
        k = self.spec.k if k is None else k
        draft = early_exit.draft(
            last, pos, cache, k, sampling.temperature, sampling.top_p, sampling.generator, forced
        )
        target = processed_logprobs(
            early_exit.verify_logits(draft, pos, cache), sampling.temperature, sampling.top_p
        )  # [B, K+1, V]
        self.batch.counters.draft_layer_passes += (k + 1) * early_exit.exit_layer
        self.batch.counters.full_forwards += 1
        result = rejection_sample(
            target, draft.tokens, draft.logprobs, generator=sampling.generator
        )
        return Emitted.verified(result, torch.full_like(result.accepted, k))

    def _verify_ngram(
        self, active: list[Row], drafts: list[list[int]], last: torch.Tensor, pos: torch.Tensor
    ) -> Emitted:
        k = max(len(d) for d in drafts)
        cache = self.batch.bind(active, [len(d) for d in drafts])
        if k == 0:
            return self._plain_step(cache, last, pos)
        sampling = self.sampling
        draft_tokens, num_drafts = self._pad_drafts(drafts, k)
        inputs = torch.cat([last[:, None], draft_tokens], dim=1)  # [B, K+1]
        positions = pos[:, None] + torch.arange(k + 1, device=self.device)
        target = processed_logprobs(
            self.policy.model(inputs, positions, cache), sampling.temperature, sampling.top_p
        )  # [B, K+1, V]
        self.batch.counters.full_forwards += 1
        result = rejection_sample(
            target, draft_tokens, None, num_drafts, generator=sampling.generator
        )
        return Emitted.verified(result, num_drafts)

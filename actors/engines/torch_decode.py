"""Decoding steps of the torch engine: plain sampling, or drafts (early exit, n-gram, both, or
the EAGLE-3 head: :mod:`actors.engines.torch_eagle`) verified by the full model, for every row
of the batch at once. Rows have their own positions; the cache is written at each row's
position before it is attended to (see :mod:`common.model`), so every row accepts its own
number of tokens per step."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.draft_length import EAGLE, EARLY_EXIT, NGRAM, PLAIN, DraftLength
from actors.drafting import EagleDrafter, EarlyExitDrafter, NgramDrafter
from actors.engines.torch_eagle import EagleSteps, concat_aux
from actors.engines.torch_rows import Counters, Row
from actors.paged_cache import PagedKVCache
from actors.speculative import SpecResult, pad_rows, rejection_sample
from common.config.actor import SpecConfig
from common.model import Transformer
from common.sampling import processed_logprobs, sample_tokens


class DecodeSteps(EagleSteps):
    """The decoding half of :class:`actors.engines.torch_engine.TorchEngine`."""

    model: Transformer
    cache: PagedKVCache
    spec: SpecConfig
    early_exit: EarlyExitDrafter | None
    ngram: NgramDrafter | None
    eagle: EagleDrafter | None  # spec.method=eagle3
    draft_length: DraftLength | None  # spec.adaptive: picks each step's drafter and k
    device: torch.device
    generator: torch.Generator
    pad_id: int
    temperature: float
    top_p: float
    _counters: Counters
    _verified: tuple[list[int], list[int]] | None = None  # last verification: accepted, proposed

    def _write_cache(
        self, rows: list[Row], sequences: list[list[int]], aux: list | None = None
    ) -> int:
        """Run the current weights over each row's ``sequence`` from position 0, writing its
        cache (no LM head: nothing is sampled); returns the tokens pushed through. ``aux``:
        appended with the forward's auxiliary states (``Transformer.run_layers``)."""
        width = max(len(s) for s in sequences)
        if width == 0:
            return 0
        ids = pad_rows(sequences, width, self.pad_id, self.device)
        positions = torch.arange(width, device=self.device).expand(len(rows), -1)
        cache = self.cache.bind([r.id for r in rows])
        layers = self.model.args.num_hidden_layers
        x = self.model.model.embed_tokens(ids)
        self.model.run_layers(x, positions, cache, 0, layers, aux=aux)
        return ids.numel()

    def _bind(self, active: list[Row], ahead: Sequence[int]) -> PagedKVCache:
        """Blocks for every row's pending token and ``ahead[i]`` slots after it; binds them."""
        for row, extra in zip(active, ahead, strict=True):
            self.cache.reserve(row.id, row.pos + 1 + extra)
        return self.cache.bind([r.id for r in active])

    def _step(self, active: list[Row]) -> list:
        """One decoding step of every row of the batch: per row (tokens, logprobs) emitted."""
        if active[0].prefix or any(r.prefix for r in active):
            return self._first_step(active)
        last = torch.tensor([r.last for r in active], dtype=torch.long, device=self.device)
        pos = torch.tensor([r.pos for r in active], dtype=torch.long, device=self.device)
        if self.draft_length is not None:
            return self._adaptive_step(active, last, pos, self.draft_length)
        k = self.spec.k
        if self.eagle is not None:
            return self._eagle_step(active, last, pos, k)
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

    def _adaptive_step(
        self, active: list[Row], last: torch.Tensor, pos: torch.Tensor, control: DraftLength
    ) -> list:
        """A step whose drafter and draft length ``control`` picks from the past only (n-gram
        matches of the tokens so far, earlier steps' times and acceptance: exact whatever it
        picks); the step's wall time and acceptance go back to it."""
        ids = [r.id for r in active]
        drafts: list[list[int]] = []

        def match_lengths() -> list[int]:
            assert self.ngram is not None
            drafts[:] = self.ngram.propose_rows(ids, self.spec.k)
            return [len(d) for d in drafts]

        matches = None
        if self.ngram is not None:
            # Hybrid's early-exit steps draft the matches first: look them up every step.
            matches = match_lengths() if self.early_exit is not None else match_lengths
        choice = control.choose(len(active), matches)
        self._counters.count_choice(choice.kind, choice.k, self.spec.k, self.spec.method)
        k, forced = choice.k, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # newcomers' prefill is not this step's time
        started = control.clock()
        self._verified = None
        if self.eagle is not None:
            assert choice.kind in (PLAIN, EAGLE)
            emitted = self._eagle_step(active, last, pos, k)
        elif choice.kind == PLAIN:
            emitted = self._plain_step(self._bind(active, [0] * len(active)), last, pos)
        elif choice.kind == NGRAM:
            emitted = self._verify_ngram(active, [d[:k] for d in drafts], last, pos)
        else:
            assert choice.kind == EARLY_EXIT
            forced = [d[:k] for d in drafts] if choice.ngram_prefix else None
            cache = self._bind(active, [k] * len(active))
            emitted = self._early_exit_step(cache, last, pos, forced, k)
        seconds = control.clock() - started
        accepted, proposed = self._verified or (None, None)
        lengths = None if forced is None else [len(f) for f in forced]
        control.record(choice, len(active), seconds, accepted, proposed, lengths)
        return emitted

    def _first_step(self, active: list[Row]) -> list:
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
        ids = pad_rows(unique, width, self.pad_id, self.device)
        positions = torch.arange(width, device=self.device).expand(len(unique), -1)
        cache = self.cache.bind([active[first[seq]].id for seq in unique])
        taps: list[torch.Tensor] | None = [] if self.eagle is not None else None
        x = self.model.model.embed_tokens(ids)
        layers = self.model.args.num_hidden_layers
        hidden = self.model.model.norm(self.model.run_layers(x, positions, cache, 0, layers, taps))
        self._counters.full_forwards += 1
        self.cache.copy_prefix(
            [
                (active[first[seq]].id, row.id, len(seq))
                for j, (row, seq) in enumerate(zip(active, seqs, strict=True))
                if first[seq] != j
            ]
        )
        inverse = torch.tensor([slot[seq] for seq in seqs], device=self.device)  # [B]
        if taps is not None:  # the head's states of the prompt and the pending token
            states = concat_aux(self.model, taps)[inverse]  # [B, W, n_aux * H]
            for row, row_states in zip(active, states, strict=True):
                row.head_pos, row.head_aux = 0, [row_states[: len(row.prefix) + 1]]
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
        draft_tokens = pad_rows(drafts, k, self.pad_id, self.device)
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
        k: int | None = None,
    ) -> list:
        assert self.early_exit is not None
        k = self.spec.k if k is None else k
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
        self, active: list[Row], drafts: list[list[int]], last: torch.Tensor, pos: torch.Tensor
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

    def _spec_emitted(self, result: SpecResult, num_drafts: torch.Tensor) -> list:
        """Per-row (tokens, logprobs) from a SpecResult, and the acceptance counters."""
        accepted, proposed = result.accepted.tolist(), num_drafts.tolist()
        self._counters.count_drafts(accepted, proposed)
        self._verified = accepted, proposed
        emitted_n = result.num_emitted.tolist()
        tokens = result.tokens.tolist()
        logprobs = result.logprobs.tolist()
        return [
            (tokens[b][: emitted_n[b]], logprobs[b][: emitted_n[b]]) for b in range(len(accepted))
        ]

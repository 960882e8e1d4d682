"""Rollout engine on the repository's own transformer: batched sampling with a per-row KV cache,
plain or self-speculative (early-exit or n-gram drafts verified by the full model), with weight
updates applied while rollouts are in flight (delayed verification, abort, or keep)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from actors.drafting import EarlyExitDrafter, NgramDrafter
from actors.engines.rollout_engine import Rollout
from actors.inflight import Verification, verify_rows
from actors.speculative import rejection_sample
from common.config import INFLIGHT_MODES, SpecConfig
from common.model import KVCache, Transformer
from common.sampling import processed_logprobs, sample_tokens


@dataclass
class _Rows:
    """Per-row generation state; index i of every list is original row i."""

    prompts: list[list[int]]
    budget: int
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    """Policy version of every token (they differ within a row only in ``keep`` and
    ``verify_on_finish`` modes, before verification)."""
    finished: list[bool] = field(default_factory=list)
    unverified: set[int] = field(default_factory=set)
    """verify_on_finish: rows that were in flight at a swap and still hold unverified tokens."""

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in self.prompts]
        self.logprobs = [[] for _ in self.prompts]
        self.versions = [[] for _ in self.prompts]
        self.finished = [False] * len(self.prompts)

    def emit(
        self, row: int, tokens: Sequence[int], logprobs: Sequence[float], version: int, eos_id: int
    ) -> bool:
        """Append tokens up to EOS or the budget; True when the row is done."""
        for token, lp in zip(tokens, logprobs, strict=True):
            self.tokens[row].append(int(token))
            self.logprobs[row].append(float(lp))
            self.versions[row].append(version)
            if token == eos_id:
                self.finished[row] = True
                return True
            if len(self.tokens[row]) >= self.budget:
                return True
        return False

    def replace(
        self, row: int, tokens: Sequence[int], logprobs: Sequence[float], version: int, eos_id: int
    ) -> bool:
        """Set a row's tokens (after verification); True when the row is done."""
        self.tokens[row], self.logprobs[row], self.versions[row] = [], [], []
        self.finished[row] = False
        return self.emit(row, tokens, logprobs, version, eos_id)


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

    Rows are right-padded prompts with their own positions; the cache is written at each row's
    position before it is attended to, so pads and rejected drafts are overwritten by real tokens
    before anyone sees them, and every row accepts its own number of tokens per step without
    re-padding. Finished rows leave the batch (``KVCache.select_rows``).
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
    ) -> None:
        if inflight not in INFLIGHT_MODES:
            raise ValueError(f"inflight must be one of {INFLIGHT_MODES}, got {inflight!r}")
        self.model = model.eval()
        self.inflight = inflight
        # Weights of older versions still needed to verify in-flight tokens exactly, and a spare
        # model instance so a swap does not allocate (double buffering).
        self._kept: dict[int, Transformer] = {}
        self._spare: Transformer | None = None
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.temperature = temperature
        self.top_p = top_p
        self.version = version
        self.spec = spec or SpecConfig()
        self.device = next(model.parameters()).device
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
        self._c = _Counters()

    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Between ``generate`` calls nothing is in flight: load in place."""
        self.model.load_state_dict(dict(state_dict), strict=True)
        self.version = version

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        weight_source: Callable[[], tuple[int, Mapping[str, torch.Tensor]] | None] | None = None,
    ) -> list[list[Rollout]]:
        """``n`` completions per prompt. ``weight_source`` is polled between decoding steps; when
        it returns ``(version, state_dict)`` the new weights are applied to the rows in flight
        according to ``inflight`` (see :mod:`actors.inflight`)."""
        started = time.perf_counter()
        if self.ngram is not None:
            self.ngram.begin()
        rows = _Rows([list(p) for p in prompts for _ in range(n)], max_new_tokens)
        batch = len(rows.prompts)
        if min(len(p) for p in rows.prompts) < 1:
            raise ValueError("every prompt needs at least one token")
        lengths = torch.tensor([len(p) for p in rows.prompts], device=self.device)  # [B]
        # Speculative steps write up to k slots past the last kept token.
        max_len = int(lengths.max()) + max_new_tokens + self.spec.k + 1
        emitted, cache = self._prefill(rows.prompts, lengths, max_len)
        active = torch.arange(batch, device=self.device)  # original row of each cache row
        new_last = torch.tensor([e[0][-1] for e in emitted], device=self.device)
        advance = torch.tensor([len(e[0]) for e in emitted], device=self.device)
        active, last, pos = self._advance(
            rows, cache, active, emitted, new_last, lengths + advance - 1
        )

        while len(active):
            if weight_source is not None:
                update = weight_source()
                if update is not None:
                    active, cache, last, pos = self._swap(
                        update, rows, active, cache, last, pos, max_len
                    )
                    if not len(active):
                        break
            if self.early_exit is not None and self.ngram is not None:
                emitted = self._hybrid_step(rows, cache, active, last, pos)
            elif self.early_exit is not None:
                emitted = self._early_exit_step(cache, last, pos)
            elif self.ngram is not None:
                emitted = self._ngram_step(rows, cache, active, last, pos)
            else:
                emitted = self._plain_step(cache, last, pos)
            new_last = torch.tensor([e[0][-1] for e in emitted], device=self.device)
            advance = torch.tensor([len(e[0]) for e in emitted], device=self.device)
            active, last, pos = self._advance(rows, cache, active, emitted, new_last, pos + advance)
            if self.inflight == "verify_on_finish" and self._kept:
                active, cache, last, pos = self._verify_finished(
                    rows, active, cache, last, pos, max_len
                )

        if self.ngram is not None:
            for prompt, completion in zip(rows.prompts, rows.tokens, strict=True):
                self.ngram.remember(_prompt_key(prompt), prompt + completion)
        self._release_unused(rows, active=[])
        self._c.tokens += sum(len(t) for t in rows.tokens)  # delivered, not counting discarded
        self._c.gen_time_s += time.perf_counter() - started
        return self._rollouts(rows, len(prompts), n)

    # ------------------------------------------------------------------ decoding steps

    def _prefill(
        self, prompts: list[list[int]], lengths: torch.Tensor, max_len: int
    ) -> tuple[list, KVCache]:
        """Prompts through the model, then the first token(s) of every row; returns the cache.

        Rows with the same prompt (a GRPO group) are prefilled once and their cache rows copied:
        the group shares its prefix. With n-gram drafting the prefill doubles as a verification
        pass: drafts for the start of the completion (copied from earlier completions of the
        prompt) are appended to the prompt and scored by the same forward, so a prompt answered
        before can be answered again in one pass.
        """
        batch = len(prompts)
        drafts: list[list[int]] = [[] for _ in range(batch)]
        if self.ngram is not None:
            drafts = self.ngram.propose(prompts, [_prompt_key(p) for p in prompts], self.spec.k)
        sequences = [tuple(p + d) for p, d in zip(prompts, drafts, strict=True)]
        unique = list(dict.fromkeys(sequences))
        slot = {seq: i for i, seq in enumerate(unique)}
        inverse = torch.tensor([slot[seq] for seq in sequences], device=self.device)  # [B]
        width = max(len(seq) for seq in unique)
        input_ids = torch.full(
            (len(unique), width), self.pad_id, dtype=torch.long, device=self.device
        )
        for i, seq in enumerate(unique):
            input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        positions = torch.arange(width, device=self.device).expand(len(unique), -1)  # [U, W]
        cache = KVCache(self.model.args, len(unique), max_len, device=self.device)
        logits = self.model(input_ids, positions, cache)[inverse]  # [B, W, V]
        cache.select_rows(inverse)  # one cache row per batch row again
        self._c.full_forwards += 1

        k = max(len(d) for d in drafts)
        # Scores of the first completion token and of each draft: positions len-1 .. len-1+K.
        at = (lengths - 1)[:, None] + torch.arange(k + 1, device=self.device)  # [B, K+1]
        at = at.clamp(max=width - 1)  # past a row's drafts: padding the sampler ignores
        target = processed_logprobs(
            logits[torch.arange(batch, device=self.device)[:, None], at],
            self.temperature,
            self.top_p,
        )  # [B, K+1, V]
        if k == 0:
            tokens, token_lp = sample_tokens(target[:, 0], self.generator)
            emitted = [
                ([t], [lp]) for t, lp in zip(tokens.tolist(), token_lp.tolist(), strict=True)
            ]
            return emitted, cache
        draft_tokens, num_drafts = self._pad_drafts(drafts, k)
        result = rejection_sample(target, draft_tokens, None, num_drafts, generator=self.generator)
        return self._spec_emitted(result, num_drafts), cache

    def _pad_drafts(self, drafts: list[list[int]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts as [B, K] (padded) and their lengths [B]."""
        draft_tokens = torch.full(
            (len(drafts), k), self.pad_id, dtype=torch.long, device=self.device
        )
        for i, d in enumerate(drafts):
            draft_tokens[i, : len(d)] = torch.tensor(d, dtype=torch.long)
        return draft_tokens, torch.tensor([len(d) for d in drafts], device=self.device)

    def _plain_step(self, cache: KVCache, last: torch.Tensor, pos: torch.Tensor) -> list:
        logits = self.model(last[:, None], pos[:, None], cache)[:, 0]  # [B, V]
        self._c.full_forwards += 1
        tokens, token_lp = sample_tokens(
            processed_logprobs(logits, self.temperature, self.top_p), self.generator
        )
        return [([t], [lp]) for t, lp in zip(tokens.tolist(), token_lp.tolist(), strict=True)]

    def _early_exit_step(
        self,
        cache: KVCache,
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
        self._c.draft_layer_passes += (k + 1) * self.early_exit.exit_layer
        self._c.full_forwards += 1
        result = rejection_sample(target, draft.tokens, draft.logprobs, generator=self.generator)
        num_drafts = torch.full_like(result.accepted, k)
        return self._spec_emitted(result, num_drafts)

    def _ngram_drafts(self, rows: _Rows, active: torch.Tensor) -> list[list[int]]:
        assert self.ngram is not None
        originals = active.tolist()
        return self.ngram.propose(
            [rows.prompts[r] + rows.tokens[r] for r in originals],
            [_prompt_key(rows.prompts[r]) for r in originals],
            self.spec.k,
            row_ids=originals,
        )

    def _hybrid_step(
        self,
        rows: _Rows,
        cache: KVCache,
        active: torch.Tensor,
        last: torch.Tensor,
        pos: torch.Tensor,
    ) -> list:
        """n-gram drafts where every row has a match (no draft forward); otherwise the early exit
        drafts, continuing after each row's n-gram match if it has one. Which way a step goes
        depends only on the tokens so far, so both stay exact."""
        drafts = self._ngram_drafts(rows, active)
        if all(drafts):
            return self._verify_ngram(drafts, cache, last, pos)
        return self._early_exit_step(cache, last, pos, forced=drafts)

    def _ngram_step(
        self,
        rows: _Rows,
        cache: KVCache,
        active: torch.Tensor,
        last: torch.Tensor,
        pos: torch.Tensor,
    ) -> list:
        return self._verify_ngram(self._ngram_drafts(rows, active), cache, last, pos)

    def _verify_ngram(
        self, drafts: list[list[int]], cache: KVCache, last: torch.Tensor, pos: torch.Tensor
    ) -> list:
        k = max(len(d) for d in drafts)
        if k == 0:
            return self._plain_step(cache, last, pos)
        draft_tokens, num_drafts = self._pad_drafts(drafts, k)
        inputs = torch.cat([last[:, None], draft_tokens], dim=1)  # [B, K+1]
        positions = pos[:, None] + torch.arange(k + 1, device=self.device)
        target = processed_logprobs(
            self.model(inputs, positions, cache), self.temperature, self.top_p
        )  # [B, K+1, V]
        self._c.full_forwards += 1
        result = rejection_sample(target, draft_tokens, None, num_drafts, generator=self.generator)
        return self._spec_emitted(result, num_drafts)

    def _spec_emitted(self, result, num_drafts: torch.Tensor) -> list:
        """Per-row (tokens, logprobs) from a SpecResult, and the acceptance counters."""
        self._c.verify_steps += len(num_drafts)
        accepted = result.accepted.tolist()
        proposed = num_drafts.tolist()
        kmax = max(proposed) if proposed else 0
        if len(self._c.proposed_at) < kmax:
            grow = kmax - len(self._c.proposed_at)
            self._c.proposed_at += [0] * grow
            self._c.accepted_at += [0] * grow
        for a, m in zip(accepted, proposed, strict=True):
            self._c.proposed += m
            self._c.accepted += a
            for i in range(m):
                self._c.proposed_at[i] += 1
                self._c.accepted_at[i] += int(a > i)
        emitted_n = result.num_emitted.tolist()
        tokens = result.tokens.tolist()
        logprobs = result.logprobs.tolist()
        return [
            (tokens[b][: emitted_n[b]], logprobs[b][: emitted_n[b]]) for b in range(len(accepted))
        ]

    # ------------------------------------------------------------------ bookkeeping

    def _advance(
        self,
        rows: _Rows,
        cache: KVCache,
        active: torch.Tensor,
        emitted: list,
        last: torch.Tensor,
        pos: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Record emitted tokens; drop finished rows from the batch and the cache."""
        keep = []
        for j, row in enumerate(active.tolist()):
            tokens, logprobs = emitted[j]
            done = rows.emit(row, tokens, logprobs, self.version, self.eos_id)
            if not done:
                keep.append(j)
        if len(keep) < len(active):
            idx = torch.tensor(keep, dtype=torch.long, device=self.device)
            cache.select_rows(idx)
            active, last, pos = active[idx], last[idx], pos[idx]
        return active, last, pos

    # ------------------------------------------------------------------ weights in flight

    def _new_model(self, state_dict: Mapping[str, torch.Tensor]) -> Transformer:
        # Built and loaded outside inference mode (generate runs inside it): parameters made
        # there would be inference tensors that a later in-place load_weights may not update.
        with torch.inference_mode(False):
            model = self._spare or Transformer(self.model.args).to(self.device)
            self._spare = None
            model.load_state_dict(dict(state_dict), strict=True)
        return model.eval()

    def _set_model(self, model: Transformer, version: int) -> None:
        self.model, self.version = model, version
        if self.early_exit is not None:
            self.early_exit.model = model

    def _swap(
        self,
        update: tuple[int, Mapping[str, torch.Tensor]],
        rows: _Rows,
        active: torch.Tensor,
        cache: KVCache,
        last: torch.Tensor,
        pos: torch.Tensor,
        max_len: int,
    ) -> tuple[torch.Tensor, KVCache, torch.Tensor, torch.Tensor]:
        """Apply new weights to the rows in flight according to ``self.inflight``."""
        version, state_dict = update
        old_model, old_version = self.model, self.version
        self._set_model(self._new_model(state_dict), version)
        originals = active.tolist()
        self._c.swaps += 1
        self._c.inflight_tokens += sum(len(rows.tokens[r]) for r in originals)
        prompts = [rows.prompts[r] for r in originals]
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)

        if self.inflight == "keep":
            # PipelineRL-style baseline: stale tokens (and their stale KV) stay; the learner's
            # truncated importance weights are left to correct them.
            self._spare = old_model
            return active, cache, last, pos
        if self.inflight == "abort":
            for r in originals:
                self._c.wasted_tokens += len(rows.tokens[r])
                rows.replace(r, [], [], version, self.eos_id)
            self._spare = old_model
            emitted, cache = self._prefill(prompts, lengths, max_len)
            new_last = torch.tensor([e[0][-1] for e in emitted], device=self.device)
            advance = torch.tensor([len(e[0]) for e in emitted], device=self.device)
            active, last, pos = self._advance(
                rows, cache, active, emitted, new_last, lengths + advance - 1
            )
            return active, cache, last, pos
        if self.inflight == "verify_on_finish":
            # Recompute the cache under the new weights (the token not yet in the cache stays
            # pending) and keep the old weights until every row holding old tokens is verified.
            self._kept[old_version] = old_model
            rows.unverified.update(originals)
            tokens = [rows.tokens[r][:-1] for r in originals]
            cache = self._fresh_cache(prompts, tokens, max_len)
            return active, cache, last, pos

        verified = self._verify(
            rows, originals, {**self._kept, old_version: old_model}, max_len, bonus=True
        )
        self._spare = old_model
        return self._apply_verification(rows, originals, verified, lengths)

    def _verify(
        self,
        rows: _Rows,
        which: list[int],
        old_models: Mapping[int, Transformer],
        max_len: int,
        bonus: bool,
    ) -> Verification:
        """Delayed verification of rows ``which`` against the current weights."""
        return verify_rows(
            self.model,
            self.version,
            old_models,
            [rows.prompts[r] for r in which],
            [rows.tokens[r] for r in which],
            [rows.versions[r] for r in which],
            self.temperature,
            self.top_p,
            max_len,
            self.generator,
            bonus=bonus,
            pad_id=self.pad_id,
        )

    def _apply_verification(
        self, rows: _Rows, originals: list[int], verified: Verification, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, KVCache, torch.Tensor, torch.Tensor]:
        """Replace the rows' tokens with the verified ones; rows that are done leave the batch."""
        self._c.verify_forward_tokens += verified.forward_tokens
        keep = []
        for j, r in enumerate(originals):
            accepted = verified.accepted[j]
            # Tokens already of the new version are accepted by construction; only stale ones
            # measure drift and count as salvaged. Everything after a cut is discarded.
            stale = [(i, gap) for i, gap in enumerate(verified.gaps[j]) if gap > 0]
            self._c.salvaged_tokens += sum(i < accepted for i, _ in stale)
            self._c.wasted_tokens += len(verified.gaps[j]) - accepted
            for i, gap in stale:
                self._c.gap_proposed[gap] = self._c.gap_proposed.get(gap, 0) + 1
                self._c.gap_accepted[gap] = self._c.gap_accepted.get(gap, 0) + int(i < accepted)
            done = rows.replace(
                r, verified.tokens[j], verified.logprobs[j], self.version, self.eos_id
            )
            if not done:
                keep.append(j)
        cache = verified.cache
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        cache.select_rows(idx)
        active = torch.tensor([originals[j] for j in keep], dtype=torch.long, device=self.device)
        last = torch.tensor(
            [rows.tokens[originals[j]][-1] for j in keep], dtype=torch.long, device=self.device
        )
        pos = lengths[idx] + torch.tensor(
            [len(rows.tokens[originals[j]]) - 1 for j in keep], dtype=torch.long, device=self.device
        )
        return active, cache, last, pos

    def _fresh_cache(
        self, prompts: list[list[int]], tokens: list[list[int]], max_len: int
    ) -> KVCache:
        """A cache of ``prompt + tokens`` per row computed with the current weights."""
        width = max(len(p) + len(t) for p, t in zip(prompts, tokens, strict=True))
        input_ids = torch.full(
            (len(prompts), width), self.pad_id, dtype=torch.long, device=self.device
        )
        for i, (p, t) in enumerate(zip(prompts, tokens, strict=True)):
            input_ids[i, : len(p) + len(t)] = torch.tensor(p + t, dtype=torch.long)
        cache = KVCache(self.model.args, len(prompts), max_len, device=self.device)
        self.model(
            input_ids, torch.arange(width, device=self.device).expand(len(prompts), -1), cache
        )
        self._c.verify_forward_tokens += input_ids.numel()
        return cache

    def _verify_finished(
        self,
        rows: _Rows,
        active: torch.Tensor,
        cache: KVCache,
        last: torch.Tensor,
        pos: torch.Tensor,
        max_len: int,
    ) -> tuple[torch.Tensor, KVCache, torch.Tensor, torch.Tensor]:
        """verify_on_finish: rows that just finished holding tokens of older versions are checked
        against the current weights; a cut row rejoins the batch and decodes on."""
        in_batch = set(active.tolist())
        due = sorted(rows.unverified - in_batch)
        rows.unverified -= set(due)
        if due:
            prompts = [rows.prompts[r] for r in due]
            lengths = torch.tensor([len(p) for p in prompts], device=self.device)
            verified = self._verify(rows, due, self._kept, max_len, bonus=False)
            back, back_cache, back_last, back_pos = self._apply_verification(
                rows, due, verified, lengths
            )
            if len(back):
                cache.append_rows(back_cache)
                active = torch.cat([active, back])
                last = torch.cat([last, back_last])
                pos = torch.cat([pos, back_pos])
        self._release_unused(rows, active.tolist())
        return active, cache, last, pos

    def _release_unused(self, rows: _Rows, active: list[int]) -> None:
        """Drop kept weights no row still needs (verification of finished rows happens first)."""
        if not self._kept:
            return
        needed = {v for r in active for v in rows.versions[r]}
        for version in [v for v in self._kept if v not in needed]:
            self._spare = self._kept.pop(version)

    def _rollouts(self, rows: _Rows, num_prompts: int, n: int) -> list[list[Rollout]]:
        results: list[list[Rollout]] = []
        for i in range(num_prompts):
            group = []
            for j in range(n):
                row = i * n + j
                group.append(
                    Rollout(
                        token_ids=np.asarray(rows.tokens[row], dtype=np.int32),
                        behaviour_logprobs=np.asarray(rows.logprobs[row], dtype=np.float32),
                        token_versions=np.asarray(rows.versions[row], dtype=np.int32),
                        finished=rows.finished[row],
                    )
                )
            results.append(group)
        return results

    def stats(self) -> dict[str, float]:
        """Counters since the last call (then reset): throughput and acceptance figures."""
        c = self._c
        out = {
            "actor/tokens": float(c.tokens),
            "actor/forward_passes": float(c.full_forwards),
            "actor/gen_time_s": c.gen_time_s,
            "actor/tokens_per_s": c.tokens / c.gen_time_s if c.gen_time_s else 0.0,
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
        self._c = _Counters()
        return out


def _prompt_key(prompt: Sequence[int]) -> str:
    return ",".join(map(str, prompt))

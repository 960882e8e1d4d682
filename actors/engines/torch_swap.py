"""Weights updates of the torch engine, also while rollouts are in flight: the rows in the batch
are verified against the new weights (delayed verification, at the swap or when they finish),
aborted, or kept as they are (see :mod:`actors.inflight`). With ``spec.method=eagle3`` the head
comes with every version (a version without it is refused) and the rows' head states follow
the swap (:mod:`actors.engines.torch_eagle`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import torch

from actors.drafting import EagleDrafter, EarlyExitDrafter, NgramDrafter
from actors.engines.torch_eagle import concat_aux, tapped_aux
from actors.engines.torch_rows import Call, Counters, Row
from actors.inflight import Verification, verify_rows
from actors.paged_cache import PagedKVCache
from common.model import Transformer

VERIFY_SCORE_BYTES = 64 * 2**20
"""Bytes of one [rows, tokens + 1, V] float32 score tensor that delayed verification builds at a
time (rows are verified in chunks that fit)."""


class WeightSwaps:
    """The weights half of :class:`actors.engines.torch_engine.TorchEngine`: loading, double
    buffering, and what a swap does to the rows in flight (``inflight``). Uses the engine's
    ``_retire`` and ``_write_cache`` (:class:`actors.engines.torch_decode.DecodeSteps`)."""

    model: Transformer
    version: int
    inflight: str
    cache: PagedKVCache
    early_exit: EarlyExitDrafter | None
    ngram: NgramDrafter | None
    eagle: EagleDrafter | None
    device: torch.device
    dtype: torch.dtype
    generator: torch.Generator
    eos_id: int
    pad_id: int
    temperature: float
    top_p: float
    _counters: Counters
    _kept: dict[int, Transformer]  # older versions still needed to verify in-flight tokens
    _spare: Transformer | None  # a retired model to load the next version into (see _keep_spare)
    _adopted: bool  # whether models take their published tensors (see _adoptable)
    # eagle3: per row id, the auxiliary states of the last delayed verification's forward
    _refreshed: dict[int, torch.Tensor] | None = None

    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Between ``generate`` calls nothing is in flight: adopt the tensors, or load in place."""
        self._check_head(version, state_dict)
        if self._adoptable(state_dict):
            self._set_model(self._adopt(state_dict), version)
            self._spare = None
            return
        self.model.load_state_dict(dict(state_dict), strict=True)
        self._set_model(self.model, version)

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
        if self.eagle is not None:
            self.eagle.use(model, version)

    def _swap(
        self,
        call: Call,
        update: tuple[int, Mapping[str, torch.Tensor]],
        active: list[Row],
        pending: deque[Row],
    ) -> None:
        """Apply new weights to the rows in flight according to ``self.inflight``."""
        version, state_dict = update
        self._check_head(version, state_dict)
        old_model, old_version = self.model, self.version
        self._set_model(self._new_model(state_dict), version)
        self._counters.swaps += 1
        self._counters.inflight_tokens += sum(len(r.tokens) for r in active)
        if self.inflight == "abort":
            # Back to the head of the queue, in order: they start again with the new weights.
            for row in reversed(active):
                self._counters.wasted_tokens += len(row.tokens)
                row.replace([], [], version, self.eos_id)
                self.cache.release(row.id)
                pending.appendleft(row)
            active.clear()
        # keep, the PipelineRL-style baseline: stale tokens (and their stale KV) stay; the
        # learner's truncated importance weights are left to correct them.
        if self.inflight == "keep" or not active:
            if self.eagle is not None:
                self._eagle_invalidate(active)  # their cache keeps the older weights
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
            taps: list[torch.Tensor] | None = [] if self.eagle is not None else None
            self._counters.verify_forward_tokens += self._write_cache(
                active, [r.prompt + r.tokens[:-1] for r in active], taps
            )
            if taps is not None:
                for row, states in zip(active, concat_aux(self.model, taps), strict=True):
                    self._eagle_restart(row, states)
            return
        verified = self._verify(active, {**self._kept, old_version: old_model}, bonus=True)
        self._keep_spare(old_model)
        done = self._apply_verification(call, list(active), verified, active)
        for row in done:
            self._retire(call, row)

    def _verify(
        self, rows: list[Row], old_models: Mapping[int, Transformer], bonus: bool
    ) -> Verification:
        """Delayed verification of ``rows`` against the current weights; the new cache is
        written into the rows' own blocks."""
        for row in rows:
            self.cache.reserve(row.id, len(row.prompt) + len(row.tokens))
        # Rows are verified a few at a time so that their [rows, tokens + 1, V] score tensors
        # stay within VERIFY_SCORE_BYTES (a real vocabulary makes them the largest thing here).
        per_row = (max(len(r.tokens) for r in rows) + 1) * self.model.args.vocab_size * 4
        step = max(1, VERIFY_SCORE_BYTES // per_row)
        parts = []
        self._refreshed = {} if self.eagle is not None else None
        for chunk in (rows[i : i + step] for i in range(0, len(rows), step)):
            with tapped_aux(self.model, self.eagle is not None) as found:
                parts.append(
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
                )
            if self._refreshed is not None:  # the head's states of the rewritten cache
                for row, states in zip(chunk, concat_aux(self.model, found), strict=True):
                    self._refreshed[row.id] = states
        return Verification.concat(parts)

    def _apply_verification(
        self, call: Call, rows: list[Row], verified: Verification, active: list[Row]
    ) -> list[Row]:
        """Replace the rows' tokens with the verified ones. Rows still going are (or go back)
        in ``active``; the rows that are done are returned."""
        self._counters.verify_forward_tokens += verified.forward_tokens
        done = []
        going = {id(r) for r in active}
        for j, row in enumerate(rows):
            accepted = verified.accepted[j]
            self._counters.count_stale(verified.gaps[j], accepted)
            row.kv_version = self.version
            if row.replace(verified.tokens[j], verified.logprobs[j], self.version, self.eos_id):
                done.append(row)
                continue
            if self.ngram is not None:
                self.ngram.truncate(row.id, len(row.prompt) + accepted)
                self.ngram.extend(row.id, row.tokens[accepted:])
            row.last, row.pos = row.tokens[-1], len(row.prompt) + len(row.tokens) - 1
            if self._refreshed is not None:
                self._eagle_restart(row, self._refreshed[row.id])
            if not call.static:
                self.cache.trim(row.id, row.pos + 1)
            if id(row) not in going:
                active.append(row)
        self._refreshed = None
        if done:
            gone = {id(r) for r in done}
            active[:] = [r for r in active if id(r) not in gone]
        return done

    def _verify_finished(self, call: Call, active: list[Row], done: list[Row]) -> list[Row]:
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

    def _release_unused(self, active: list[Row]) -> None:
        """Drop kept weights no row still needs (verification of finished rows happens first)."""
        if not self._kept:
            return
        needed = {v for r in active for v in r.versions}
        for version in [v for v in self._kept if v not in needed]:
            self._keep_spare(self._kept.pop(version))

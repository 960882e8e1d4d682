"""Weights updates of the torch engine, also while rollouts are in flight: the rows in the batch
are verified against the new weights (delayed verification, at the swap or when they finish),
aborted, or kept as they are (see :mod:`actors.decoding.inflight`). With ``spec.method=eagle3`` the head
comes with every version (a version without it is refused) and the rows' head states follow
the swap (:mod:`actors.engines.torch.eagle`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from actors.decoding.eagle import EagleDrafter
from actors.decoding.early_exit import EarlyExitDrafter
from actors.decoding.inflight import Verification, verify_rows
from actors.decoding.ngram import NgramDrafter
from actors.engines.rollout_engine import StaleDraftError
from actors.engines.torch.decode import Decoder
from actors.engines.torch.eagle import concat_aux, drop_states, restart_states, tapped_aux
from actors.engines.torch.rows import Batch, Call, Policy, Row, Sampling
from common.eagle import EAGLE_PREFIX
from common.model import Transformer
from common.model_args import with_tied_head

VERIFY_SCORE_BYTES = 64 * 2**20
"""Bytes of one [rows, tokens + 1, V] float32 score tensor that delayed verification builds at a
time (rows are verified in chunks that fit)."""


class WeightSwapper:
    """The torch engine's weight updates: loading into ``policy`` (the drafters that run the
    policy's layers follow it), double buffering, and what a swap does to the rows in flight
    (``inflight``), on ``batch``'s cache; ``decoder`` rewrites a row's cache under new weights
    (``verify_on_finish``)."""

    def __init__(
        self,
        policy: Policy,
        batch: Batch,
        sampling: Sampling,
        decoder: Decoder,
        *,
        inflight: str,
        pad_id: int,
        device: torch.device,
        dtype: torch.dtype,
        early_exit: EarlyExitDrafter | None = None,
        ngram: NgramDrafter | None = None,
        eagle: EagleDrafter | None = None,
    ) -> None:
        self.policy, self.batch, self.sampling, self.decoder = policy, batch, sampling, decoder
        self.inflight, self.pad_id = inflight, pad_id
        self.device, self.dtype = device, dtype
        self.early_exit, self.ngram, self.eagle = early_exit, ngram, eagle
        self.kept: dict[int, Transformer] = {}  # older versions still needed to verify tokens
        self.spare: Transformer | None = None  # a retired model to load the next version into
        self.adopted = False  # whether models take their published tensors (see _adoptable)
        # eagle3: per row id, the auxiliary states of the last delayed verification's forward
        self.refreshed: dict[int, torch.Tensor] | None = None

    # ------------------------------------------------------------------ loading

    def load(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Between ``generate`` calls nothing is in flight: adopt the tensors, or load in place."""
        self.check_head(version, state_dict)
        if self._adoptable(state_dict):
            self._use(self._adopt(state_dict), version)
            self.spare = None
            return
        self.policy.model.load_state_dict(self._loadable(state_dict), strict=True)
        self._use(self.policy.model, version)

    def check_head(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Refuse a version without the head while the head drafts (before anything changes)."""
        if self.eagle is None or any(name.startswith(EAGLE_PREFIX) for name in state_dict):
            return
        raise StaleDraftError(
            f"weights version {version} has no EAGLE-3 head ({EAGLE_PREFIX}* tensors), but "
            f"spec.method=eagle3 drafts with the head of every version: refused, the engine "
            f"stays on version {self.policy.version}; publish the head with every version"
        )

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
            model = Transformer(self.policy.model.args)
        model.load_state_dict(self._loadable(state_dict), strict=True, assign=True)
        model.tie_weights()  # assign=True gives each name its own Parameter
        self.adopted = True
        return model.eval()

    def _loadable(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A published version as the model loads it (a tied LM head is the embedding)."""
        return with_tied_head(state_dict, self.policy.model.args)

    def _keep_spare(self, old: Transformer) -> None:
        """Keep a retired model to load the next version into (double buffering), unless models
        adopt their published tensors: then it holds only an old version's buffer."""
        self.spare = None if self.adopted else old

    def _new_model(self, state_dict: Mapping[str, torch.Tensor]) -> Transformer:
        # Built and loaded outside inference mode (generate runs inside it): parameters made
        # there would be inference tensors that a later in-place load may not update.
        if self._adoptable(state_dict):
            self.spare = None  # the fetched tensors become the new model: nothing to reuse
            return self._adopt(state_dict)
        with torch.inference_mode(False):
            args = self.policy.model.args
            model = self.spare or Transformer(args).to(self.device, self.dtype)
            self.spare = None
            model.load_state_dict(self._loadable(state_dict), strict=True)
        return model.eval()

    def _use(self, model: Transformer, version: int) -> None:
        self.policy.model, self.policy.version = model, version
        if self.early_exit is not None:
            self.early_exit.model = model
        if self.eagle is not None:
            self.eagle.use(model, version)

    # ------------------------------------------------------------------ rows in flight

    def swap(self, call: Call, update: tuple[int, Mapping[str, torch.Tensor]]) -> list[Row]:
        """Apply new weights to the rows in flight (``call.active``) according to
        ``inflight``; returns the rows that are done (after verification at the swap)."""
        version, state_dict = update
        self.check_head(version, state_dict)
        old_model, old_version = self.policy.model, self.policy.version
        self._use(self._new_model(state_dict), version)
        active, counters = call.active, self.batch.counters
        counters.swaps += 1
        counters.inflight_tokens += sum(len(r.tokens) for r in active)
        if self.inflight == "abort":
            # Back to the head of the queue, in order: they start again with the new weights.
            for row in reversed(active):
                counters.wasted_tokens += len(row.tokens)
                row.replace([], [], version)
                self.batch.cache.release(row.id)
                call.pending.appendleft(row)
            active.clear()
        # keep, the PipelineRL-style baseline: stale tokens (and their stale KV) stay; the
        # learner's truncated importance weights are left to correct them.
        if self.inflight == "keep" or not active:
            if self.eagle is not None:
                drop_states(active)  # their cache keeps the older weights
            self._keep_spare(old_model)
            return []
        if self.inflight == "verify_on_finish":
            # Recompute the rows' cache under the new weights in their own blocks (the token not
            # yet in the cache stays pending) and keep the old weights until every row holding
            # old tokens is verified.
            self.kept[old_version] = old_model
            for row in active:
                row.unverified = True
                row.kv_version = version
            taps: list[torch.Tensor] | None = [] if self.eagle is not None else None
            counters.verify_forward_tokens += self.decoder.prefill(
                active, [r.prompt + r.tokens[:-1] for r in active], taps
            )
            if taps is not None:
                for row, states in zip(active, concat_aux(self.policy.model, taps), strict=True):
                    restart_states(row, states)
            return []
        verified = self.verify(active, {**self.kept, old_version: old_model}, bonus=True)
        self._keep_spare(old_model)
        return self._apply_verification(call, list(active), verified)

    def verify(
        self, rows: list[Row], old_models: Mapping[int, Transformer], bonus: bool
    ) -> Verification:
        """Delayed verification of ``rows`` against the current weights; the new cache is
        written into the rows' own blocks."""
        cache, model, sampling = self.batch.cache, self.policy.model, self.sampling
        for row in rows:
            cache.reserve(row.id, len(row.prompt) + len(row.tokens))
        # Rows are verified a few at a time so that their [rows, tokens + 1, V] score tensors
        # stay within VERIFY_SCORE_BYTES (a real vocabulary makes them the largest thing here).
        per_row = (max(len(r.tokens) for r in rows) + 1) * model.args.vocab_size * 4
        step = max(1, VERIFY_SCORE_BYTES // per_row)
        parts = []
        self.refreshed = {} if self.eagle is not None else None
        for chunk in (rows[i : i + step] for i in range(0, len(rows), step)):
            with tapped_aux(model, self.eagle is not None) as found:
                parts.append(
                    verify_rows(
                        model,
                        self.policy.version,
                        old_models,
                        [r.prompt for r in chunk],
                        [r.tokens for r in chunk],
                        [r.versions for r in chunk],
                        sampling.temperature,
                        sampling.top_p,
                        cache.bind([r.id for r in chunk]),
                        sampling.generator,
                        bonus=bonus,
                        pad_id=self.pad_id,
                    )
                )
            if self.refreshed is not None:  # the head's states of the rewritten cache
                for row, states in zip(chunk, concat_aux(model, found), strict=True):
                    self.refreshed[row.id] = states
        return Verification.concat(parts)

    def _apply_verification(self, call: Call, rows: list[Row], verified: Verification) -> list[Row]:
        """Replace the rows' tokens with the verified ones. Rows still going are (or go back)
        in ``call.active``; the rows that are done are returned."""
        counters, version, active = self.batch.counters, self.policy.version, call.active
        counters.verify_forward_tokens += verified.forward_tokens
        done = []
        going = {id(r) for r in active}
        for j, row in enumerate(rows):
            accepted = verified.accepted[j]
            counters.count_stale(verified.gaps[j], accepted)
            row.kv_version = version
            if row.replace(verified.tokens[j], verified.logprobs[j], version):
                done.append(row)
                continue
            if self.ngram is not None:
                self.ngram.truncate(row.id, len(row.prompt) + accepted)
                self.ngram.extend(row.id, row.tokens[accepted:])
            row.last, row.pos = row.tokens[-1], len(row.prompt) + len(row.tokens) - 1
            if self.refreshed is not None:
                restart_states(row, self.refreshed[row.id])
            if not call.static:
                self.batch.cache.trim(row.id, row.pos + 1)
            if id(row) not in going:
                active.append(row)
        self.refreshed = None
        if done:
            gone = {id(r) for r in done}
            active[:] = [r for r in active if id(r) not in gone]
        return done

    def verify_finished(self, call: Call, done: list[Row]) -> list[Row]:
        """verify_on_finish, while older weights are kept: rows that just finished holding
        tokens of older versions are checked against the current weights; a cut row goes back
        into the batch and decodes on. Returns the rows that are done for good."""
        if self.inflight != "verify_on_finish" or not self.kept:
            return done
        due = [r for r in done if r.unverified]
        final = [r for r in done if not r.unverified]
        if due:
            for row in due:
                row.unverified = False
            verified = self.verify(due, self.kept, bonus=False)
            final += self._apply_verification(call, due, verified)
        self.release_unused(call.active)
        return final

    def release_unused(self, active: list[Row]) -> None:
        """Drop kept weights no row still needs (verification of finished rows happens first)."""
        if not self.kept:
            return
        needed = {v for r in active for v in r.versions}
        for version in [v for v in self.kept if v not in needed]:
            self._keep_spare(self.kept.pop(version))

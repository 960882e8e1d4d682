"""EAGLE-3 drafting in the torch engine (``spec.method=eagle3``): the policy's head
(common/eagle.py) drafts, the policy verifies, :func:`actors.speculative.rejection_sample` keeps
the samples exact.

The head reads the policy's auxiliary states (the residual stream after
``args.eagle_aux_layers`` layers) at position t with the token at t + 1, so a row's states
come from the forwards that ran its positions: the prefill of its prompt, each decoding step's
(plain or verify) forward, the forward that recomputes its cache after a weight swap. They wait
on the row (``Row.head_aux``, positions [``head_pos``, ``pos``)) until the row drafts: the
first pass runs the head over them (writing its KV, cache layer ``args.eagle_cache_layer``, at
those positions), its last output drafts d_1, and k - 1 one-token passes on the head's own
output draft the rest (vLLM's order, shared/notes/eagle3-vllm-0.32.md §2). A plain step (k = 0,
``spec.adaptive``) only keeps its states, so it costs what a plain step costs.

The head's KV is valid at [0, ``head_pos``) only: draft passes write at ``pos`` onwards, and
every slot from ``head_pos`` on is written again (by the next first pass, or a draft pass)
before any query reads it, whatever was accepted; pads of shorter rows land at slots that are
overwritten the same way. Rows of different lengths, rows joining and leaving and cache trims
need nothing more (states live on the row; ``pos`` >= ``head_pos`` always).

Weight swaps: the head is the policy's, so it always drafts with the current version; a row's
states and head KV are recomputed from the forward that rewrites its cache (``verify_on_swap``,
``verify_on_finish``), restart with it (``abort``), or, where the cache keeps older weights
(``keep``), the row drafts no more (its k is 0): drafts never read a stale head's KV.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from actors.drafting import EagleDrafter
from actors.engines.rollout_engine import StaleDraftError
from actors.engines.torch_rows import Counters, Row
from actors.paged_cache import PagedKVCache
from actors.speculative import rejection_sample
from common.config.actor import SpecConfig
from common.eagle import EAGLE_PREFIX
from common.model import Transformer
from common.sampling import processed_logprobs, sample_tokens

CATCH_UP = 2
"""A row with more than k + CATCH_UP states waiting (a prompt, a swap, a run of plain steps) runs
all but its last through the head on its own first, so the batch's first pass stays k + 1 wide."""


@contextmanager
def tapped_aux(model: Transformer, enabled: bool = True) -> Iterator[dict[int, Tensor]]:
    """The auxiliary states of the forwards of ``model`` run inside (forward hooks; none unless
    ``enabled``): layer index -> the residual stream after it, the latest forward's, for code
    that does not pass ``aux`` to ``run_layers`` (delayed verification, actors/inflight.py)."""
    found: dict[int, Tensor] = {}
    handles = []
    for i in model.args.eagle_aux_layers if enabled else ():
        module = model.model.embed_tokens if i == 0 else model.model.layers[i - 1]

        def hook(_module, _inputs, output, i=i) -> None:
            found[i] = output

        handles.append(module.register_forward_hook(hook))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def concat_aux(model: Transformer, found: dict[int, Tensor] | list[Tensor]) -> Tensor:
    """[B, T, n_aux * H]: the states in layer order (as ``EagleHead.combine`` reads them)."""
    if isinstance(found, dict):
        found = [found[i] for i in model.args.eagle_aux_layers]
    return torch.cat(list(found), dim=-1)


class EagleSteps:
    """The EAGLE-3 half of :class:`actors.engines.torch_engine.TorchEngine`'s decoding."""

    model: Transformer
    version: int
    cache: PagedKVCache
    spec: SpecConfig
    eagle: EagleDrafter | None
    device: torch.device
    generator: torch.Generator
    pad_id: int
    temperature: float
    top_p: float
    _counters: Counters
    _verified: tuple[list[int], list[int]] | None

    # ------------------------------------------------------------------ the rows' states

    def _check_head(self, version: int, state_dict) -> None:
        """Refuse a version without the head while the head drafts (before anything changes)."""
        if self.eagle is None or any(name.startswith(EAGLE_PREFIX) for name in state_dict):
            return
        raise StaleDraftError(
            f"weights version {version} has no EAGLE-3 head ({EAGLE_PREFIX}* tensors), but "
            f"spec.method=eagle3 drafts with the head of every version: refused, the engine "
            f"stays on version {self.version}; publish the head with every version"
        )

    def _eagle_keep(self, rows: Sequence[Row], aux: Tensor, counts: Sequence[int]) -> None:
        """Rows' states of a forward: row b keeps ``aux[b, :counts[b]]`` (its positions from
        its ``pos`` on, before the step advances it)."""
        for row, states, n in zip(rows, aux, counts, strict=True):
            if row.head_ok and n:
                row.head_aux.append(states[:n])

    def _eagle_restart(self, row: Row, aux: Tensor) -> None:
        """The row's states from a forward over its whole sequence (``aux`` [>= pos, n_aux*H]):
        the head's KV is rewritten from position 0 at its next draft."""
        row.head_pos, row.head_aux, row.head_ok = 0, [aux[: row.pos]], True

    def _eagle_copy(self, donor: Row, row: Row, length: int) -> None:
        """``row`` got its first ``length`` cache slots (every layer's) from ``donor``'s: the
        head's KV where the donor's is valid, the donor's waiting states for the rest."""
        row.head_pos = min(donor.head_pos, length)
        row.head_aux = []
        if donor.head_pos < length:
            row.head_aux = [torch.cat(donor.head_aux)[: length - donor.head_pos]]

    def _eagle_invalidate(self, rows: Sequence[Row]) -> None:
        """Rows whose cache keeps older weights (``keep``): they draft no more."""
        for row in rows:
            row.head_ok, row.head_aux = False, []

    # ------------------------------------------------------------------ head passes

    def _eagle_inputs(
        self, rows: Sequence[Row], counts: Sequence[int]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The first pass's inputs over each row's first ``counts[b]`` waiting states, right
        padded: states [B, T, n_aux*H], next tokens [B, T], positions [B, T] (a row without
        states runs pads from its ``pos``: slots that are written again before being read)."""
        width = max(max(counts), 1)
        args = self.model.args
        size = len(args.eagle_aux_layers) * args.hidden_size
        aux = torch.zeros((len(rows), width, size), device=self.device, dtype=self.model_dtype)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long, device=self.device)
        starts = []
        for b, (row, n) in enumerate(zip(rows, counts, strict=True)):
            starts.append(row.head_pos if n else row.pos)
            if n:
                aux[b, :n] = torch.cat(row.head_aux)[:n]
                span = row.span(row.head_pos + 1, row.head_pos + 1 + n)
                ids[b, :n] = torch.tensor(span, dtype=torch.long)
        positions = torch.tensor(starts, device=self.device)[:, None] + torch.arange(
            width, device=self.device
        )
        return aux, ids, positions

    @property
    def model_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _eagle_catch_up(self, rows: Sequence[Row]) -> None:
        """All but the last waiting state of ``rows`` through the head (KV only)."""
        assert self.eagle is not None
        counts = [r.head_pending() - 1 for r in rows]
        aux, ids, positions = self._eagle_inputs(rows, counts)
        self.eagle.head_pass(aux, ids, positions, self.cache.bind([r.id for r in rows]))
        for row, n in zip(rows, counts, strict=True):
            row.head_aux = [torch.cat(row.head_aux)[n:]]
            row.head_pos += n

    # ------------------------------------------------------------------ decoding steps

    def _eagle_plain(self, active: list[Row], last: Tensor, pos: Tensor) -> list:
        """A plain step that keeps the states of its positions for the head."""
        cache = self._bind(active, [0] * len(active))
        taps: list[Tensor] = []
        x = self.model.model.embed_tokens(last[:, None])
        h = self.model.run_layers(
            x, pos[:, None], cache, 0, self.model.args.num_hidden_layers, aux=taps
        )
        self._counters.full_forwards += 1
        logits = self.model.head(h)[:, 0]  # [B, V] fp32
        tokens, token_lp = sample_tokens(
            processed_logprobs(logits, self.temperature, self.top_p), self.generator
        )
        self._eagle_keep(active, concat_aux(self.model, taps), [1] * len(active))
        return [([t], [lp]) for t, lp in zip(tokens.tolist(), token_lp.tolist(), strict=True)]

    def _eagle_step(self, active: list[Row], last: Tensor, pos: Tensor, k: int) -> list:
        """k drafts per row from the head (rows without states to draft from: none), verified
        by one forward of the policy; k = 0 is a plain step."""
        eagle = self.eagle
        assert eagle is not None
        if eagle.version != self.version or eagle.model is not self.model:
            raise StaleDraftError(
                f"the EAGLE-3 head holds weights version {eagle.version}, the policy "
                f"{self.version}: the head must come with the policy"
            )
        ready = [r.head_ok and r.head_pending() > 0 for r in active]
        if k == 0 or not any(ready):
            return self._eagle_plain(active, last, pos)
        behind = [r for r, ok in zip(active, ready, strict=True) if ok]
        behind = [r for r in behind if r.head_pending() > k + 1 + CATCH_UP]
        if behind:
            self._eagle_catch_up(behind)
        cache = self._bind(active, [k] * len(active))
        counts = [r.head_pending() if ok else 0 for r, ok in zip(active, ready, strict=True)]
        aux, ids, positions = self._eagle_inputs(active, counts)
        out = eagle.head_pass(aux, ids, positions, cache)  # [B, T, H]
        at = torch.tensor([max(n, 1) - 1 for n in counts], device=self.device)
        first = out[torch.arange(len(active), device=self.device), at]  # [B, H]
        draft = eagle.draft(first, pos, cache, k, self.temperature, self.top_p, self.generator)
        num_drafts = torch.tensor([k if ok else 0 for ok in ready], device=self.device)
        drafts = torch.where(num_drafts[:, None] > 0, draft.tokens, self.pad_id)
        # The verify forward, keeping its states for the head's next first pass.
        inputs = torch.cat([last[:, None], drafts], dim=1)  # [B, K+1]
        verify_pos = pos[:, None] + torch.arange(k + 1, device=self.device)
        taps: list[Tensor] = []
        layers = self.model.args.num_hidden_layers
        x = self.model.model.embed_tokens(inputs)
        h = self.model.run_layers(x, verify_pos, cache, 0, layers, aux=taps)
        target = processed_logprobs(self.model.head(h), self.temperature, self.top_p)
        self._counters.full_forwards += 1
        self._counters.draft_layer_passes += k
        self._counters.draft_version = eagle.version
        result = rejection_sample(
            target, drafts, draft.logprobs, num_drafts, generator=self.generator
        )
        for row, n in zip(active, counts, strict=True):
            if n:  # through the head now: its KV holds them
                row.head_pos += n
                row.head_aux = []
        self._eagle_keep(active, concat_aux(self.model, taps), result.num_emitted.tolist())
        return self._spec_emitted(result, num_drafts)

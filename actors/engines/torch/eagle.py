"""EAGLE-3 drafting in the torch engine (``spec.method=eagle3``): the policy's head
(common/eagle.py) drafts, the policy verifies, :func:`actors.decoding.sampler.rejection_sample` keeps
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

from actors.decoding.eagle import EagleDrafter
from actors.decoding.sampler import rejection_sample
from actors.engines.rollout_engine import StaleDraftError
from actors.engines.torch.rows import Batch, Emitted, Policy, Row, Sampling
from common.model import Transformer
from common.sampling import processed_logprobs, sample_tokens

CATCH_UP = 2
"""A row with more than k + CATCH_UP states waiting (a prompt, a swap, a run of plain steps) runs
all but its last through the head on its own first, so the batch's first pass stays k + 1 wide."""


@contextmanager
def tapped_aux(model: Transformer, enabled: bool = True) -> Iterator[dict[int, Tensor]]:
    """The auxiliary states of the forwards of ``model`` run inside (forward hooks; none unless
    ``enabled``): layer index -> the residual stream after it, the latest forward's, for code
    that does not pass ``aux`` to ``run_layers`` (delayed verification, actors/decoding/inflight.py)."""
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


# ------------------------------------------------------------------ the rows' states


def keep_states(rows: Sequence[Row], aux: Tensor, counts: Sequence[int]) -> None:
    """Rows' states of a forward: row b keeps ``aux[b, :counts[b]]`` (its positions from its
    ``pos`` on, before the step advances it)."""
    for row, states, n in zip(rows, aux, counts, strict=True):
        if row.head_ok and n:
            row.head_aux.append(states[:n])


def restart_states(row: Row, aux: Tensor) -> None:
    """The row's states from a forward over its whole sequence (``aux`` [>= pos, n_aux*H]): the
    head's KV is rewritten from position 0 at its next draft."""
    row.head_pos, row.head_aux, row.head_ok = 0, [aux[: row.pos]], True


def copy_states(donor: Row, row: Row, length: int) -> None:
    """``row`` got its first ``length`` cache slots (every layer's) from ``donor``'s: the head's
    KV where the donor's is valid, the donor's waiting states for the rest."""
    row.head_pos = min(donor.head_pos, length)
    row.head_aux = []
    if donor.head_pos < length:
        row.head_aux = [torch.cat(donor.head_aux)[: length - donor.head_pos]]


def drop_states(rows: Sequence[Row]) -> None:
    """Rows whose cache keeps older weights (``keep``): they draft no more."""
    for row in rows:
        row.head_ok, row.head_aux = False, []


# ------------------------------------------------------------------ decoding steps


class EagleSteps:
    """The torch engine's decoding steps with the EAGLE-3 head ``eagle``: drafts of the head
    verified by ``policy``'s model over ``batch``'s cache, with ``sampling``'s distribution and
    generator."""

    def __init__(
        self,
        eagle: EagleDrafter,
        policy: Policy,
        batch: Batch,
        sampling: Sampling,
        pad_id: int,
        device: torch.device,
    ) -> None:
        self.eagle, self.policy, self.batch, self.sampling = eagle, policy, batch, sampling
        self.pad_id, self.device = pad_id, device

    def step(self, active: list[Row], last: Tensor, pos: Tensor, k: int) -> Emitted:
        """k drafts per row from the head (rows without states to draft from: none), verified
        by one forward of the policy; k = 0 is a plain step."""
        eagle, policy, sampling = self.eagle, self.policy, self.sampling
        if eagle.version != policy.version or eagle.model is not policy.model:
            raise StaleDraftError(
                f"the EAGLE-3 head holds weights version {eagle.version}, the policy "
                f"{policy.version}: the head must come with the policy"
            )
        ready = [r.head_ok and r.head_pending() > 0 for r in active]
        if k == 0 or not any(ready):
            return self._plain(active, last, pos)
        behind = [r for r, ok in zip(active, ready, strict=True) if ok]
        behind = [r for r in behind if r.head_pending() > k + 1 + CATCH_UP]
        if behind:
            self._catch_up(behind)
        cache = self.batch.bind(active, [k] * len(active))
        counts = [r.head_pending() if ok else 0 for r, ok in zip(active, ready, strict=True)]
        aux, ids, positions = self._inputs(active, counts)
        out = eagle.head_pass(aux, ids, positions, cache)  # [B, T, H]
        at = torch.tensor([max(n, 1) - 1 for n in counts], device=self.device)
        first = out[torch.arange(len(active), device=self.device), at]  # [B, H]
        draft = eagle.draft(
            first, pos, cache, k, sampling.temperature, sampling.top_p, sampling.generator
        )
        num_drafts = torch.tensor([k if ok else 0 for ok in ready], device=self.device)
        drafts = torch.where(num_drafts[:, None] > 0, draft.tokens, self.pad_id)
        # The verify forward, keeping its states for the head's next first pass.
        inputs = torch.cat([last[:, None], drafts], dim=1)  # [B, K+1]
        verify_pos = pos[:, None] + torch.arange(k + 1, device=self.device)
        taps: list[Tensor] = []
        model = policy.model
        x = model.model.embed_tokens(inputs)
        h = model.run_layers(x, verify_pos, cache, 0, model.args.num_hidden_layers, aux=taps)
        target = processed_logprobs(model.head(h), sampling.temperature, sampling.top_p)
        counters = self.batch.counters
        counters.full_forwards += 1
        counters.draft_layer_passes += k
        counters.draft_version = eagle.version
        result = rejection_sample(
            target, drafts, draft.logprobs, num_drafts, generator=sampling.generator
        )
        for row, n in zip(active, counts, strict=True):
            if n:  # through the head now: its KV holds them
                row.head_pos += n
                row.head_aux = []
        keep_states(active, concat_aux(model, taps), result.num_emitted.tolist())
        return Emitted.verified(result, num_drafts)

    def _plain(self, active: list[Row], last: Tensor, pos: Tensor) -> Emitted:
        """A plain step that keeps the states of its positions for the head."""
        model, sampling = self.policy.model, self.sampling
        cache = self.batch.bind(active, [0] * len(active))
        taps: list[Tensor] = []
        x = model.model.embed_tokens(last[:, None])
        h = model.run_layers(x, pos[:, None], cache, 0, model.args.num_hidden_layers, aux=taps)
        self.batch.counters.full_forwards += 1
        logits = model.head(h)[:, 0]  # [B, V] fp32
        tokens, token_lp = sample_tokens(
            processed_logprobs(logits, sampling.temperature, sampling.top_p), sampling.generator
        )
        keep_states(active, concat_aux(model, taps), [1] * len(active))
        return Emitted.sampled(tokens, token_lp)

    def _inputs(self, rows: Sequence[Row], counts: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """The first pass's inputs over each row's first ``counts[b]`` waiting states, right
        padded: states [B, T, n_aux*H], next tokens [B, T], positions [B, T] (a row without
        states runs pads from its ``pos``: slots that are written again before being read)."""
        width = max(max(counts), 1)
        model = self.policy.model
        size = len(model.args.eagle_aux_layers) * model.args.hidden_size
        dtype = next(model.parameters()).dtype
        aux = torch.zeros((len(rows), width, size), device=self.device, dtype=dtype)
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

    def _catch_up(self, rows: Sequence[Row]) -> None:
        """All but the last waiting state of ``rows`` through the head (KV only)."""
        counts = [r.head_pending() - 1 for r in rows]
        aux, ids, positions = self._inputs(rows, counts)
        self.eagle.head_pass(aux, ids, positions, self.batch.cache.bind([r.id for r in rows]))
        for row, n in zip(rows, counts, strict=True):
            row.head_aux = [torch.cat(row.head_aux)[n:]]
            row.head_pos += n

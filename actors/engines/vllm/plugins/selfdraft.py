"""The policy's own trained draft inside vLLM (``spec=early_exit``), as a ``custom_class`` proposer.

:class:`SelfDraft` is a torch copy of what the draft needs from the policy: the embedding, the
first ``draft_exit_layer`` decoder layers and the draft adapter (``spec.adapter``; without it
the first ``spec.exit_layer`` layers, the final norm and the LM head), as a truncated
:class:`~common.model.Transformer`. It reads them from the same tensors vLLM receives:
from the checkpoint at start, and in :meth:`SelfDraft.load` from the state dict of every swap,
in the same call that reloads vLLM (``VllmEngine.load_weights``), so the draft carries the
target's version. :class:`SpecrlSelfDraftProposer` refuses to draft when the two differ.

Per request the proposer keeps the draft's KV in its own block pool
(:class:`~actors.decoding.paged_cache.PagedKVCache`) and the tokens that KV was computed for; each step
it runs the tokens the request gained since (usually the accepted drafts' last one and the
bonus token), then ``k`` draft tokens sampled from ``q``. vLLM's ``custom_class`` call passes no
draft probabilities, so the proposer hands ``q`` to the model runner through the slots vLLM's
own draft-model and EAGLE proposers fill (``_draft_probs`` / ``_draft_prob_req_ids``, read by
``_get_spec_decode_draft_probs`` before the rejection sampler), and vLLM's standard rejection
sampler accepts ``d`` with ``min(1, p(d) / q(d))`` and resamples from ``max(p - q, 0)``: an exact
sample of the target. Where the runner does not find them it treats the drafts as one-hot, which
is exact for any draft drawn independently of its uniforms, only with a lower acceptance.

With ``spec.adaptive``, :class:`~actors.decoding.draft_length.DraftLength` picks each step's ``k`` (0: no
drafts, a plain vLLM step) from the acceptance by draft position and the measured time of each
step (from one ``propose`` call to the next), as on the torch engine.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from actors.decoding.draft_length import EARLY_EXIT, NGRAM, PLAIN, Choice, DraftLength
from actors.decoding.paged_cache import PagedKVCache
from actors.engines.rollout_engine import StaleDraftError
from actors.engines.vllm.compat import request_key
from common.cpu_precision import bf16_is_fast
from common.layers import DecoderLayer
from common.model import (
    CONFIG_FILE,
    DRAFT_FILE,
    DRAFT_PREFIX,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    DraftAdapter,
    Transformer,
)
from common.model_args import ModelArgs, with_tied_head
from common.sampling import processed_logprobs, sample_tokens

log = logging.getLogger(__name__)

SELFDRAFT_PATH = "actors.engines.vllm.plugins.selfdraft.SpecrlSelfDraftProposer"
BLOCK_SIZE = 16

_PENDING: list[SpecrlSelfDraftProposerSetup] = []


class SelfDraft:
    """The draft's torch copy of the policy (see the module docstring). ``version``: the weights
    version its tensors come from."""

    def __init__(
        self,
        args: ModelArgs,
        tensors: dict[str, torch.Tensor],
        adapter: bool,
        exit_layer: int,
        version: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if adapter:
            if not args.draft_exit_layer:
                raise ValueError(
                    "spec.adapter=true, but the checkpoint has no draft adapter "
                    "(config.json has no draft_exit_layer): warm-start one (specrl warm-draft "
                    "...) or use spec.adapter=false"
                )
            exit_layer = args.draft_exit_layer
        elif not 1 <= exit_layer < args.num_hidden_layers:
            raise ValueError(
                f"spec.exit_layer={exit_layer} must be in [1, {args.num_hidden_layers - 1}] for a "
                f"{args.num_hidden_layers}-layer model (the draft must be cheaper than the model)"
            )
        self.adapter, self.exit_layer, self.device = adapter, exit_layer, device
        self.full_layers = args.num_hidden_layers
        # One layer more than the draft runs: ModelArgs wants draft_exit_layer < layers. That
        # layer is dropped below; only the cache keeps a slot for it (unused).
        self.args = replace(
            args,
            num_hidden_layers=exit_layer + 1,
            draft_exit_layer=exit_layer if adapter else 0,
            draft_vocab_size=args.draft_vocab_size if adapter else 0,
            eagle_aux_layers=(),  # an EAGLE-3 head reads deeper layers; this draft has none
            eagle_vocab_size=0,
        )
        with torch.device("meta"):
            model = Transformer(self.args)
        model.model.layers = nn.ModuleList(list(model.model.layers)[:exit_layer])
        state = {
            k: t.to(device, dtype if t.is_floating_point() else t.dtype)
            for k, t in self._select(tensors).items()
        }
        state = with_tied_head(state, self.args)
        model.load_state_dict(state, strict=True, assign=True)
        model.tie_weights()
        self.model = model.eval()
        self.version = version
        self.vocab_ids = self.model.draft.vocab_ids if adapter else None
        self._head: Any = None  # the draft vocabulary's LM head rows, as a linear map
        self._pack()

    def _pack(self) -> None:
        """Bind the draft's linear maps to the platform's GEMM: on CPU, where vLLM's backend
        has oneDNN, the prepacked kernel vLLM's CPU backend runs the target with (faster than
        ``F.linear`` at decoding's few rows: the proposer's share of a self-draft row's time in
        ``benchmarks/engines.py --only real``); elsewhere ``F.linear``. Packed weights are
        copies: :meth:`load` calls this again after writing the new tensors."""
        gemm = _cpu_gemm() if self.device.type == "cpu" else None
        with torch.no_grad():
            head = self.model.lm_head.weight
            if self.adapter:
                head = self.model.draft.head_weight(head)
            for module in self.model.modules():
                if isinstance(module, nn.Linear) and module is not self.model.lm_head:
                    if gemm is None:
                        module.__dict__.pop("forward", None)
                    else:
                        module.forward = gemm(module.weight, module.bias)
            self._head = gemm(head, None) if gemm is not None else partial(F.linear, weight=head)

    def names(self) -> set[str]:
        """The tensor names the draft reads from a published version or a checkpoint."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.args.tie_word_embeddings:
            names.add("lm_head.weight")
        with torch.device("meta"):
            layer = list(DecoderLayer(self.args).state_dict())
            adapter = list(DraftAdapter(self.args).state_dict()) if self.adapter else []
        for i in range(self.exit_layer):
            names |= {f"model.layers.{i}.{n}" for n in layer}
        return names | {DRAFT_PREFIX + n for n in adapter}

    def check(self, tensors) -> None:
        """Raise ValueError unless ``tensors`` hold everything the draft reads."""
        self._select(tensors)

    def _select(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = self.names()
        missing = sorted(names - tensors.keys())
        if missing:
            hint = (
                " (a version without the draft adapter: publish it with spec.adapter=true, or "
                "set spec.adapter=false)"
                if any(m.startswith(DRAFT_PREFIX) for m in missing)
                else ""
            )
            raise ValueError(f"the self-draft needs tensors the weights lack: {missing[:4]}{hint}")
        return {k: tensors[k].detach() for k in names}

    @torch.no_grad()
    def load(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy the draft's tensors of ``version`` in place (a published state dict: policy
        tensors and ``draft.*``)."""
        current = self.model.state_dict()
        for name, t in self._select(tensors).items():
            current[name].copy_(t)  # cast to the draft's dtype
        self._pack()
        self.version = version

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: Path,
        adapter: bool,
        exit_layer: int,
        version: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> SelfDraft:
        """The draft of the checkpoint at ``model_dir`` (only the tensors it needs are read)."""
        model_dir = Path(model_dir)
        args = ModelArgs.from_hf_config(json.loads((model_dir / CONFIG_FILE).read_text()))
        files = [model_dir / WEIGHTS_FILE]
        if not files[0].exists():
            index = json.loads((model_dir / WEIGHTS_INDEX_FILE).read_text())
            files = [model_dir / f for f in sorted(set(index["weight_map"].values()))]
        if adapter and args.draft_exit_layer:
            files.append(model_dir / DRAFT_FILE)
        wanted = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
        layers = args.draft_exit_layer if adapter and args.draft_exit_layer else exit_layer
        tensors: dict[str, torch.Tensor] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    layer = name.split(".")[2] if name.startswith("model.layers.") else None
                    if (
                        name in wanted
                        or name.startswith(DRAFT_PREFIX)
                        or (layer is not None and int(layer) < layers)
                    ):
                        tensors[name] = f.get_tensor(name)
        return cls(args, tensors, adapter, exit_layer, version, device, dtype)

    # ------------------------------------------------------------------ drafting

    def layers(self, tokens: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache):
        """The draft's layers over tokens [B, T] at positions [B, T] (KV written): h [B, T, H]."""
        x = self.model.model.embed_tokens(tokens)
        return self.model.run_layers(x, positions, cache, 0, self.exit_layer)

    def logprobs(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        last: torch.Tensor,
        cache: PagedKVCache,
        temperature: float,
        top_p: float,
    ) -> torch.Tensor:
        """Processed log q [B, V_draft] over the draft's vocabulary (the token ids
        ``vocab_ids``; the whole vocabulary when None) at each row's position ``last`` [B] of
        the residual stream h [B, T, H] after the exit; the adapter writes its KV at every one
        of ``positions`` [B, T] first."""
        if self.adapter:
            h = self.model.draft_hidden(h, positions, cache)
        h = h.gather(1, last[:, None, None].expand(-1, 1, h.shape[-1]))[:, 0]  # [B, H]
        if not self.adapter:
            h = self.model.model.norm(h)
        return processed_logprobs(self._head(h).float(), temperature, top_p)

    def full_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """Probabilities over the draft's vocabulary [..., V_draft] as [..., V] (zero outside)."""
        if self.vocab_ids is None:
            return q
        out = q.new_zeros((*q.shape[:-1], self.args.vocab_size))
        out[..., self.vocab_ids] = q
        return out


@dataclass
class SpecrlSelfDraftProposerSetup:
    """What the engine hands the proposer it is about to build (see :func:`pending`)."""

    draft: SelfDraft
    temperature: float
    top_p: float
    seed: int
    draft_length: DraftLength | None


def pending(setup: SpecrlSelfDraftProposerSetup) -> None:
    """The draft the next :class:`SpecrlSelfDraftProposer` constructed in this process uses."""
    _PENDING.append(setup)


@dataclass
class _Row:
    slot: int  # the row id in the block pool
    written: list[int]  # tokens whose draft KV is in the pool, from position 0


def claim_pending(pending: list, proposer: str, needs: str) -> Any:
    """What the engine left for the ``custom_class`` proposer vLLM is now constructing (the
    newest entry of ``pending``), or a RuntimeError saying how the proposer must be built."""
    if not pending:
        raise RuntimeError(
            f"{proposer} is built by actors.engines.vllm.engine.VllmEngine (it needs {needs}); "
            "do not name it in a bare vLLM config, and run the engine core in-process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0)"
        )
    return pending.pop()


class StepTimer:
    """Adaptive draft length on vLLM: the step a ``propose`` call decides runs between it and the
    next call; that call records the step's wall time and per row the drafts accepted (vLLM's
    ``sampled_token_ids``: the accepted drafts and one token more)."""

    def __init__(self, control: DraftLength) -> None:
        self.control = control
        self._open: tuple[Choice, int, float, dict[str, int]] | None = None

    def pause(self) -> None:
        """Forget the step in progress (a new call or a swap: the gap is not a step's time)."""
        self._open = None

    def close(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        if self._open is None:
            return
        choice, rows, started, proposed = self._open
        self._open = None
        seconds = self.control.clock() - started
        accepted_rows, proposed_rows = [], []
        if choice.kind != PLAIN:
            for rid, tokens in zip(req_ids, sampled, strict=False):
                n = proposed.get(rid)
                if n and tokens:
                    proposed_rows.append(n)
                    accepted_rows.append(min(len(tokens) - 1, n))
        self.control.record(choice, rows, seconds, accepted_rows or None, proposed_rows or None)

    def choose(self, rows: int, matches=None) -> Choice:
        return self.control.choose(rows, matches)

    def open(self, choice: Choice, rows: int, started: float, proposed: dict[str, int]) -> None:
        self._open = (choice, rows, started, proposed)


class SpecrlSelfDraftProposer:
    """``propose`` for vLLM's ``custom_class`` method; see the module docstring."""

    def __init__(self, vllm_config: Any) -> None:
        setup = claim_pending(_PENDING, "SpecrlSelfDraftProposer", "the engine's draft")
        self.draft = setup.draft
        self.temperature, self.top_p = setup.temperature, setup.top_p
        self.generator = torch.Generator(device=self.draft.device).manual_seed(setup.seed)
        self.timer = StepTimer(setup.draft_length) if setup.draft_length is not None else None
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.cache = PagedKVCache(
            self.draft.args, BLOCK_SIZE, self.draft.device, self.draft.model.lm_head.weight.dtype
        )
        self.target_version: int = self.draft.version
        self.check_version = True  # False only in the stale-draft negative control
        self.runner: Any = None
        self._known: set[str] = set()
        self._rows: dict[str, _Row] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self.draft_seconds = 0.0
        # Per row, drafts proposed, accepted and verify steps with drafts (vLLM's own counters
        # are process-wide: these are this proposer's).
        self.counts = {"proposed": 0, "accepted": 0, "verified": 0}
        self._last: dict[str, int] = {}

    def stale(self) -> bool:
        return self.draft.version != self.target_version

    def check(self) -> None:
        """Raise :class:`StaleDraftError` if the draft is not the target's version."""
        if self.check_version and self.stale():
            raise StaleDraftError(
                f"the draft holds weights version {self.draft.version}, the target "
                f"{self.target_version}: the draft must be reloaded in the same swap"
            )

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load here: the engine built the draft (vLLM's CPU runner calls this)."""

    def register(self, request_id: str, prompt_key: str | None = None) -> None:
        """A request the engine submits (``request_id`` as passed to vLLM): only these are
        drafted for (delayed verification's scoring requests are not)."""
        self._known.add(request_id)

    def unregister(self, request_id: str) -> None:
        self._known.discard(request_id)

    def reload(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """The swap's draft half: the draft's tensors of ``version``; every request's draft KV
        is recomputed under them."""
        self.draft.load(version, tensors)
        self.target_version = version
        self.forget()

    def forget(self) -> None:
        for row in self._rows.values():
            self._release(row)
        self._rows = {}
        self.pause()

    def pause(self) -> None:
        """Time until the next ``propose`` is not a decoding step (a new call, a swap)."""
        if self.timer is not None:
            self.timer.pause()

    def _release(self, row: _Row) -> None:
        self.cache.release(row.slot)
        self._free_slots.append(row.slot)

    def _slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._next_slot += 1
        return self._next_slot - 1

    # ------------------------------------------------------------------ the vLLM call

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **kwargs):
        assert self.runner is not None, "the engine attaches the model runner after start-up"
        now = time.perf_counter()
        step_started = self.timer.control.clock() if self.timer is not None else now
        req_ids = list(self.runner.input_batch.req_ids)
        if self.timer is not None:
            self.timer.close(req_ids, sampled_token_ids)
        for rid, sampled in zip(req_ids, sampled_token_ids, strict=False):
            n = self._last.get(rid)
            if n and sampled:
                self.counts["verified"] += 1
                self.counts["proposed"] += n
                self.counts["accepted"] += min(len(sampled) - 1, n)
        self._last = {}
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        live = set(req_ids)
        for rid in [r for r in self._rows if r not in live]:
            self._release(self._rows.pop(rid))
        rows = [
            i
            for i, sampled in enumerate(sampled_token_ids)
            if sampled and request_key(req_ids[i]) in self._known
        ]
        if not rows:
            return drafts
        if self.check_version and self.stale():
            return drafts  # never a draft older than the target (the engine raises first)
        k = self.k
        choice = None
        if self.timer is not None:
            choice = self.timer.choose(len(rows))
            k = choice.k
        if k > 0:
            contexts = [token_ids_cpu[i, : int(num_tokens_no_spec[i])] for i in rows]
            ids = [req_ids[i] for i in rows]
            proposed, q = self._draft(ids, contexts, k)
            for i, d in zip(rows, proposed, strict=True):
                drafts[i] = d
                self._last[req_ids[i]] = len(d)
            if q is not None:
                # Where vLLM's draft-model proposers leave q for the rejection sampler.
                self.runner._draft_probs = q
                self.runner._draft_prob_req_ids = ids
        if self.timer is not None:
            assert choice is not None
            lengths = {req_ids[i]: len(drafts[i]) for i in rows}
            self.timer.open(choice, len(rows), step_started, lengths)
        self.draft_seconds += time.perf_counter() - now
        return drafts

    @torch.no_grad()
    def _draft(self, ids: list[str], contexts, k: int):
        """``k`` tokens per row sampled from q, and q as probabilities [B, k, V] (None when
        greedy: vLLM then compares each draft with the target's argmax)."""
        draft, device = self.draft, self.draft.device
        pending: list[list[int]] = []
        starts: list[int] = []
        for rid, context in zip(ids, contexts, strict=True):
            context = context.tolist()
            row = self._rows.get(rid)
            if row is None:
                row = self._rows[rid] = _Row(self._slot(), [])
            common = 0
            written = row.written
            limit = min(len(written), len(context))
            while common < limit and written[common] == context[common]:
                common += 1
            common = min(common, len(context) - 1)  # the last token must run: its q is needed
            pending.append(context[common:])
            starts.append(common)
            row.written = context
            self.cache.reserve(row.slot, len(context) + k)
        width = max(len(p) for p in pending)
        tokens = torch.zeros((len(ids), width), dtype=torch.long)
        positions = torch.zeros((len(ids), width), dtype=torch.long)
        for b, (p, s) in enumerate(zip(pending, starts, strict=True)):
            tokens[b, : len(p)] = torch.tensor(p)
            # Padding sits past the row's last token, where its next write lands first.
            positions[b] = torch.arange(s, s + width)
        tokens, positions = tokens.to(device), positions.to(device)
        lengths = torch.tensor([len(p) for p in pending], device=device)
        cache = self.cache.bind([self._rows[rid].slot for rid in ids])
        last = lengths - 1
        pos = positions.gather(1, last[:, None])  # [B, 1]: the last token's position
        h = draft.layers(tokens, positions, cache)
        out, qs = [], []
        for i in range(k):
            if i > 0:
                pos = pos + 1
                h = draft.layers(out[-1][:, None], pos, cache)
                positions, last = pos, torch.zeros_like(last)
            # Sampled over the draft's vocabulary, then mapped to the model's token ids.
            logq = draft.logprobs(h, positions, last, cache, self.temperature, self.top_p)
            token, _ = sample_tokens(logq, self.generator)
            out.append(token if draft.vocab_ids is None else draft.vocab_ids[token])
            qs.append(logq)
        proposed = torch.stack(out, dim=1).tolist()
        for rid, d in zip(ids, proposed, strict=True):
            self._rows[rid].written = self._rows[rid].written + d[:-1]
        if self.temperature == 0.0:
            return proposed, None
        return proposed, draft.full_vocab(torch.stack(qs, dim=1).exp()).contiguous()


def draft_dtype(name: str, device: torch.device) -> torch.dtype:
    """``engine.vllm_draft_dtype`` on ``device`` (``auto``: see the option)."""
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if bf16_is_fast(device) else torch.float32


def _cpu_gemm():
    """``make(weight [N, K], bias)`` -> a linear map through vLLM's prepacked oneDNN GEMM, or
    None where the installed vLLM has no oneDNN kernel (a GPU build)."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    if not getattr(ops, "_supports_onednn", False):
        return None

    def make(weight: torch.Tensor, bias: torch.Tensor | None):
        if weight.dtype not in (torch.float32, torch.bfloat16):
            return partial(F.linear, weight=weight, bias=bias)
        handler = ops.create_onednn_mm(weight.detach().t(), 32)
        return partial(ops.onednn_mm, handler, bias=bias)

    return make


def adaptive_control(method: str, k: int, draft: SelfDraft | None) -> DraftLength:
    """The adaptive controller of a vLLM proposer (``ngram`` or ``early_exit``)."""
    cost = 0.0
    if draft is not None:
        cost = (draft.exit_layer + (1 if draft.adapter else 0)) / draft.full_layers
    return DraftLength(method, k, draft_cost=cost)


__all__ = [
    "EARLY_EXIT",
    "NGRAM",
    "SELFDRAFT_PATH",
    "SelfDraft",
    "SpecrlSelfDraftProposer",
    "SpecrlSelfDraftProposerSetup",
    "StaleDraftError",
    "StepTimer",
    "claim_pending",
    "adaptive_control",
    "draft_dtype",
    "pending",
]

"""specrl's n-gram drafter inside vLLM, as a ``custom_class`` speculative proposer.

vLLM 0.32 builds the proposer class named in ``speculative_config`` with the ``VllmConfig`` and
calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` after every step. It sees
every running row's tokens but no request ids or prompts, so the engine (in-process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) hands it the torch engine's
:class:`~actors.decoding.ngram.NgramDrafter` (:func:`pending`, before the ``LLM`` is built), the model
runner (to map a batch row to its request id) and each request's prompt key (:meth:`register`).
Drafts are deterministic (``q`` one-hot), so vLLM's rejection sampler keeps the output exact.
With ``spec.adaptive`` the draft length of each step comes from
:class:`~actors.decoding.draft_length.DraftLength` (given the rows' match lengths, as on the torch
engine), timed from one ``propose`` call to the next
(:class:`~actors.engines.vllm.plugins.selfdraft.StepTimer`).
"""

from __future__ import annotations

from typing import Any

from actors.decoding.draft_length import PLAIN, DraftLength
from actors.decoding.ngram import NgramDrafter
from actors.engines.vllm.compat import request_key
from actors.engines.vllm.plugins.selfdraft import StepTimer, claim_pending

_PENDING: list[tuple[NgramDrafter, DraftLength | None]] = []
PROPOSER_PATH = "actors.engines.vllm.plugins.proposer.SpecrlNgramProposer"


def pending(drafter: NgramDrafter, control: DraftLength | None = None) -> None:
    """The drafter (and adaptive controller) the next :class:`SpecrlNgramProposer` constructed in
    this process uses."""
    _PENDING.append((drafter, control))


class SpecrlNgramProposer:
    """``propose`` for vLLM's ``custom_class`` method; see the module docstring."""

    def __init__(self, vllm_config: Any) -> None:
        self.drafter, control = claim_pending(
            _PENDING, "SpecrlNgramProposer", "the engine's n-gram drafter"
        )
        self.timer = StepTimer(control) if control is not None else None
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.runner: Any = None
        self._keys: dict[str, tuple[str, int]] = {}
        self._next_row = 0

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load (vLLM's CPU runner calls this unconditionally)."""

    def register(self, request_id: str, prompt_key: str) -> None:
        """The prompt of a request the engine submits (``request_id`` as passed to vLLM); the
        drafter follows it as a row of its own, indexing only the tokens each step adds."""
        self._keys[request_id] = (prompt_key, self._next_row)
        self._next_row += 1

    def unregister(self, request_id: str) -> None:
        self._keys.pop(request_id, None)

    def pause(self) -> None:
        """Time until the next ``propose`` is not a decoding step (a new call, a swap)."""
        if self.timer is not None:
            self.timer.pause()

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **kwargs):
        assert self.runner is not None, "the engine attaches the model runner after start-up"
        now = self.timer.control.clock() if self.timer is not None else 0.0
        req_ids = list(self.runner.input_batch.req_ids)
        if self.timer is not None:
            self.timer.close(req_ids, sampled_token_ids)
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        rows, contexts, keys, row_ids = [], [], [], []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:  # partial prefill: nothing sampled yet
                continue
            # vLLM appends "-<8 random chars>" to the id it was given.
            known = self._keys.get(request_key(req_ids[row]))
            if known is None:
                continue
            rows.append(row)
            contexts.append(token_ids_cpu[row, : int(num_tokens_no_spec[row])].tolist())
            keys.append(known[0])
            row_ids.append(known[1])
        if not rows:
            return drafts
        proposed = self.drafter.propose(contexts, keys, self.k, row_ids=row_ids)
        if self.timer is not None:
            choice = self.timer.choose(len(rows), [len(d) for d in proposed])
            k = 0 if choice.kind == PLAIN else choice.k
            proposed = [d[:k] for d in proposed]
            lengths = {req_ids[r]: len(d) for r, d in zip(rows, proposed, strict=True)}
            self.timer.open(choice, len(rows), now, lengths)
        for row, draft in zip(rows, proposed, strict=True):
            drafts[row] = draft
        return drafts

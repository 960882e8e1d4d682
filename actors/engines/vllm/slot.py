"""One sample of the vLLM engine's call: the tokens it has committed and its live request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.engines.rollout_engine import Rollout
from actors.engines.vllm.verify import record_of


@dataclass
class _Slot:
    """One sample: tokens committed before the current request (after a verification or an
    abort), and the current request's latest output."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # verify_on_swap: each committed token's bounded record (top-K ids, log-probs)
    records: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    request_id: str | None = None
    live: Any = None
    live_versions: list[int] = field(default_factory=list)
    finished: bool = False

    def _live_tokens(self):
        """(token, its log-prob entry, version) of each token of the current request."""
        if self.live is None:
            return []
        completion = self.live.outputs[0]
        return zip(completion.token_ids, completion.logprobs, self.live_versions, strict=False)

    def commit_live(self, record: bool) -> None:
        """Move the current request's tokens into the committed ones (its request is gone)."""
        for token, entry, version in self._live_tokens():
            self.tokens.append(int(token))
            self.logprobs.append(entry[token].logprob)
            self.versions.append(version)
            if record:
                self.records.append(record_of(entry))
        self.live, self.live_versions = None, []

    def reset(self) -> None:
        self.tokens, self.logprobs, self.versions, self.records = [], [], [], []

    def record_bytes(self) -> int:
        return sum(ids.nbytes + lps.nbytes for ids, lps in self.records)

    def rollout(self, stop_ids: list[int]) -> Rollout:
        tokens, logprobs, versions = list(self.tokens), list(self.logprobs), list(self.versions)
        for token, entry, version in self._live_tokens():
            tokens.append(int(token))
            logprobs.append(entry[token].logprob)
            versions.append(version)
        return Rollout(
            token_ids=np.asarray(tokens, dtype=np.int32),
            behaviour_logprobs=np.asarray(logprobs, dtype=np.float32),
            token_versions=np.asarray(versions, dtype=np.int32),
            finished=bool(tokens) and tokens[-1] in stop_ids,
        )

"""Rollout engine on the repository's own transformer: batched sampling with a per-row KV cache."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from actors.engines.rollout_engine import Rollout
from common.model import KVCache, Transformer
from common.sampling import processed_logprobs, sample_tokens


class TorchEngine:
    """Plain autoregressive sampling: one full forward pass per generated token.

    Rows are right-padded prompts with their own positions; the cache is written at each row's
    position before it is attended to, so pads are overwritten by real tokens before anyone sees
    them. Finished rows leave the batch (``KVCache.select_rows``) so the others do not wait on them.
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
    ) -> None:
        self.model = model.eval()
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.temperature = temperature
        self.top_p = top_p
        self.version = version
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._tokens = 0
        self._forwards = 0
        self._gen_time_s = 0.0

    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(dict(state_dict), strict=True)
        self.version = version

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int
    ) -> list[list[Rollout]]:
        started = time.perf_counter()
        rows = [list(p) for p in prompts for _ in range(n)]
        batch = len(rows)
        lengths = torch.tensor([len(r) for r in rows], device=self.device)  # [B]
        if int(lengths.min()) < 1:
            raise ValueError("every prompt needs at least one token")
        max_prompt = int(lengths.max())
        input_ids = torch.full(
            (batch, max_prompt), self.pad_id, dtype=torch.long, device=self.device
        )
        for i, r in enumerate(rows):
            input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        positions = torch.arange(max_prompt, device=self.device).expand(batch, -1)  # [B, P]

        cache = KVCache(self.model.args, batch, max_prompt + max_new_tokens, device=self.device)
        logits = self.model(input_ids, positions, cache)  # [B, P, V]
        self._forwards += 1
        next_logits = logits[torch.arange(batch), lengths - 1]  # [B, V]

        out_tokens: list[list[int]] = [[] for _ in range(batch)]
        out_logprobs: list[list[float]] = [[] for _ in range(batch)]
        finished = [False] * batch
        active = torch.arange(batch, device=self.device)  # original row index of each cache row
        pos = lengths.clone()  # [B_active] position of the next token

        for step in range(max_new_tokens):
            lp = processed_logprobs(next_logits, self.temperature, self.top_p)
            tokens, token_lp = sample_tokens(lp, self.generator)
            tokens_l, lp_l = tokens.tolist(), token_lp.tolist()
            keep: list[int] = []
            for j, row in enumerate(active.tolist()):
                out_tokens[row].append(tokens_l[j])
                out_logprobs[row].append(lp_l[j])
                if tokens_l[j] == self.eos_id:
                    finished[row] = True
                else:
                    keep.append(j)
            self._tokens += len(tokens_l)
            if not keep or step == max_new_tokens - 1:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=self.device)
                cache.select_rows(idx)
                active, tokens, pos = active[idx], tokens[idx], pos[idx]
            next_logits = self.model(tokens.unsqueeze(-1), pos.unsqueeze(-1), cache)[:, -1]
            self._forwards += 1
            pos = pos + 1

        self._gen_time_s += time.perf_counter() - started
        results: list[list[Rollout]] = []
        for i in range(len(prompts)):
            group = []
            for j in range(n):
                row = i * n + j
                t = len(out_tokens[row])
                group.append(
                    Rollout(
                        token_ids=np.asarray(out_tokens[row], dtype=np.int32),
                        behaviour_logprobs=np.asarray(out_logprobs[row], dtype=np.float32),
                        token_versions=np.full(t, self.version, dtype=np.int32),
                        finished=finished[row],
                    )
                )
            results.append(group)
        return results

    def stats(self) -> dict[str, float]:
        out = {
            "actor/tokens": float(self._tokens),
            "actor/forward_passes": float(self._forwards),
            "actor/gen_time_s": self._gen_time_s,
            "actor/tokens_per_s": self._tokens / self._gen_time_s if self._gen_time_s else 0.0,
        }
        self._tokens, self._forwards, self._gen_time_s = 0, 0, 0.0
        return out

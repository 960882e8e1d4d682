"""A block-pool KV cache for the torch engine (docs/design.md §2.4): memory follows the rows'
actual lengths.

k/v live in one pool per tensor, ``[L, N * block_size, H_kv, D]`` in the model's dtype, cut into
``N`` blocks; each row (by id) owns a block table. For a forward, :meth:`bind` names the rows of
the batch in order; the model then calls :meth:`attention_mask` (validation, the usual
``slot <= position`` mask, and the gather/scatter indices of this forward) and :meth:`update` per
layer (write the new k/v, then gather the first ``S`` slots of every row as a dense
``[B, H_kv, S, D]``). Writes past a row's blocks land in block 0, a scratch block no row owns and
no query attends to: the causal mask stops at the query's own position, which the row's blocks
always cover.
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.model_args import ModelArgs

SCRATCH = 0
MIN_GROW = 4  # the fewest blocks the pool grows by


class PagedKVCache:
    draft_kv = False
    """Forwards through the model's ``draft_exit_layer`` also write its draft adapter's KV (set by
    an engine that drafts with the adapter; see :class:`common.model.KVCache`)."""

    def __init__(
        self,
        args: ModelArgs,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        assert args.head_dim is not None
        self.block_size, self.device, self.dtype = block_size, device, dtype
        self._shape = (args.cache_layers, args.num_key_value_heads, args.head_dim)
        self.k = self._empty(1)  # the scratch block only
        self.v = self._empty(1)
        self.free: list[int] = []  # a stack: the lowest ids are handed out first
        self.tables: dict[int, list[int]] = {}
        self.peak_bytes = self.bytes()
        self._rows: list[int] = []
        self._table: Tensor | None = None  # [B, W] block ids of the bound rows, SCRATCH-padded
        self._counts: Tensor | None = None  # [B] blocks each bound row owns
        self._write: Tensor | None = None  # [B * T] pool slot of every token of this forward
        self._read: Tensor | None = None  # [B * S] pool slot of every attended slot

    # ------------------------------------------------------------------ memory

    def _empty(self, blocks: int) -> Tensor:
        L, H, D = self._shape
        return torch.zeros(
            (L, blocks * self.block_size, H, D), device=self.device, dtype=self.dtype
        )

    def bytes(self) -> int:
        """Bytes the pool holds now (k and v)."""
        return 2 * self.k.numel() * self.k.element_size()

    def used_blocks(self) -> int:
        return sum(len(t) for t in self.tables.values())

    def _grow(self, needed: int) -> None:
        """At least ``needed`` more free blocks: the pool grows by what is missing (at least
        ``MIN_GROW`` blocks), so it stays the size of the most the rows held at once."""
        if len(self.free) >= needed:
            return
        old = self.k.shape[1] // self.block_size  # blocks in the pool, scratch included
        extra = max(needed - len(self.free), MIN_GROW)
        self.k = torch.cat([self.k, self._empty(extra)], dim=1)
        self.v = torch.cat([self.v, self._empty(extra)], dim=1)
        self.free = list(range(old + extra - 1, old - 1, -1)) + self.free
        self.peak_bytes = max(self.peak_bytes, self.bytes())

    def reserve(self, row: int, length: int) -> None:
        """Row ``row`` owns blocks for slots ``[0, length)`` (more blocks if needed)."""
        table = self.tables.setdefault(row, [])
        need = -(-length // self.block_size) - len(table)
        if need > 0:
            self._grow(need)
            table.extend(self.free.pop() for _ in range(need))

    def trim(self, row: int, length: int) -> None:
        """Free the row's blocks past slot ``length`` (a rolled-back or finished tail)."""
        table = self.tables.get(row)
        if table is None:
            return
        keep = -(-length // self.block_size)
        while len(table) > keep:
            self.free.append(table.pop())

    def release(self, row: int) -> None:
        self.trim(row, 0)
        self.tables.pop(row, None)

    def copy_prefix(self, pairs: list[tuple[int, int, int]]) -> None:
        """``(src, dst, length)``: slots ``[0, length)`` of row ``dst`` := those of row ``src``
        (a GRPO group's shared prompt, computed once). Whole blocks are copied: what lands past
        ``length`` is overwritten by ``dst`` before any query of ``dst`` can see it."""
        src_idx, dst_idx = [], []
        bs = self.block_size
        for src, dst, length in pairs:
            if length <= 0:
                continue
            self.reserve(dst, length)
            n = -(-length // bs)
            for s, d in zip(self.tables[src][:n], self.tables[dst][:n], strict=True):
                src_idx.extend(range(s * bs, (s + 1) * bs))
                dst_idx.extend(range(d * bs, (d + 1) * bs))
        if not src_idx:
            return
        src_t = torch.tensor(src_idx, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst_idx, dtype=torch.long, device=self.device)
        self.k.index_copy_(1, dst_t, self.k.index_select(1, src_t))
        self.v.index_copy_(1, dst_t, self.v.index_select(1, src_t))

    # ------------------------------------------------------------------ the model's interface

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    def bind(self, rows: list[int]) -> PagedKVCache:
        """The rows of the next forwards, in batch order (each must own at least one block)."""
        self._rows = list(rows)
        tables = [self.tables[r] for r in rows]
        width = max(len(t) for t in tables)
        padded = [t + [SCRATCH] * (width - len(t)) for t in tables]
        self._table = torch.tensor(padded, dtype=torch.long, device=self.device)
        self._counts = torch.tensor([len(t) for t in tables], device=self.device)
        return self

    def attention_mask(self, positions: Tensor, dtype: torch.dtype) -> Tensor:
        B, T = positions.shape
        if self._table is None or self._counts is None or len(self._rows) != B:
            raise ValueError(f"cache bound to {len(self._rows)} rows, batch has {B}")
        if self.dtype != dtype or self.device != positions.device:
            raise ValueError(
                f"cache is {self.dtype} on {self.device}, model runs {dtype} on {positions.device}"
            )
        lo, hi = torch.stack([positions.min(), positions.max()]).tolist()
        if lo < 0:
            raise ValueError(f"negative position {lo}")
        bs = self.block_size
        width = self._table.shape[1]
        # Where each token is written: its row's block, or scratch past the row's blocks.
        block = positions // bs  # [B, T]
        owned = block < self._counts[:, None]
        ids = self._table.gather(1, block.clamp(max=width - 1))
        self._write = (torch.where(owned, ids, SCRATCH) * bs + positions % bs).reshape(-1)
        # Where each attended slot is read from (slots past a row's blocks: scratch, masked).
        slots = torch.arange(hi + 1, device=positions.device)  # [S]
        sblock = (slots // bs).expand(B, -1)
        sowned = sblock < self._counts[:, None]
        sids = self._table.gather(1, sblock.clamp(max=width - 1))
        self._read = (torch.where(sowned, sids, SCRATCH) * bs + slots % bs).reshape(-1)
        return (slots <= positions[..., None])[:, None]  # [B, 1, T, S]

    def update(
        self, layer: int, k: Tensor, v: Tensor, positions: Tensor, width: int
    ) -> tuple[Tensor, Tensor]:
        assert self._write is not None and self._read is not None
        B, H, T, D = k.shape
        self.k[layer].index_copy_(0, self._write, k.transpose(1, 2).reshape(B * T, H, D))
        self.v[layer].index_copy_(0, self._write, v.transpose(1, 2).reshape(B * T, H, D))
        keys = self.k[layer].index_select(0, self._read).view(B, width, H, D).transpose(1, 2)
        values = self.v[layer].index_select(0, self._read).view(B, width, H, D).transpose(1, 2)
        return keys, values

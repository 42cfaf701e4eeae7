"""The query window: the last m real queries (after RoPE) of each row and their positions,
which re-ranking scores chunk importance with (SPEC §1.2). Not the sliding window of a
sliding-attention layer (:mod:`hqekv.cache.sliding`).

Shapes: queries (B, Hq, m, D), positions (B, m) int64, valid (B, m) bool, oldest first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rows import RowPart, gather_tokens, stable_order


@dataclass
class QueryWindow(RowPart):
    """``q`` (B, Hq, m, D), ``pos`` (B, m) int64, ``valid`` (B, m) bool."""

    q: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor

    PART = "window"

    @staticmethod
    def empty(like: torch.Tensor, query_heads: int, m: int, dtype: torch.dtype) -> "QueryWindow":
        """An empty window of m queries for (B, Hkv, S, D) states ``like``, in ``dtype``."""
        b, _, _, d = like.shape
        return QueryWindow(
            like.new_zeros(b, query_heads, m, d, dtype=dtype),
            torch.zeros(b, m, dtype=torch.long, device=like.device),
            torch.zeros(b, m, dtype=torch.bool, device=like.device),
        )

    def append(self, query: torch.Tensor, positions: torch.Tensor, new_valid: torch.Tensor) -> None:
        """New queries (B, Hq, S, D) at ``positions`` (B, S), padding (``new_valid`` False)
        skipped: the window then holds the last m real queries of each row (new tensors)."""
        m = self.q.shape[2]
        wq = torch.cat([self.q, query.to(self.q.dtype)], dim=2)
        wpos = torch.cat([self.pos, positions], dim=1)
        wvalid = torch.cat([self.valid, new_valid], dim=1)
        order = stable_order(wvalid, valid_first=False)[:, -m:]
        self.q, self.pos, self.valid = gather_tokens(wq, order), wpos.gather(1, order), wvalid.gather(1, order)

    def push_one(self, query: torch.Tensor, position: torch.Tensor, ok: torch.Tensor) -> None:
        """One query per row (B, Hq, 1, D) at ``position`` (B,), where ``ok`` (B,): in place,
        with fixed shapes (a decode step)."""

        def roll(window, new, dim, cond):
            rolled = torch.cat([window.narrow(dim, 1, window.shape[dim] - 1), new.to(window.dtype)], dim)
            return torch.where(cond, rolled, window)

        self.q.copy_(roll(self.q, query, 2, ok[:, None, None, None]))
        self.pos.copy_(roll(self.pos, position[:, None], 1, ok[:, None]))
        self.valid.copy_(roll(self.valid, ok[:, None], 1, ok[:, None]))

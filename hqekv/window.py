"""The query window: the last m real queries (after RoPE) of each row and their positions,
which re-ranking scores chunk importance with (SPEC §1.2).

Shapes: queries (B, Hq, m, D), positions (B, m) int64, valid (B, m) bool, oldest first.
"""

from __future__ import annotations

import torch

from .layer_base import gather_tokens, stable_order


def append(
    win_q: torch.Tensor,
    win_pos: torch.Tensor,
    win_valid: torch.Tensor,
    query: torch.Tensor,
    positions: torch.Tensor,
    new_valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The window after new queries (B, Hq, S, D) at ``positions`` (B, S), padding
    (``new_valid`` False) skipped: the last m real queries of each row. New tensors."""
    m = win_q.shape[2]
    wq = torch.cat([win_q, query.to(win_q.dtype)], dim=2)
    wpos = torch.cat([win_pos, positions], dim=1)
    wvalid = torch.cat([win_valid, new_valid], dim=1)
    order = stable_order(wvalid, valid_first=False)[:, -m:]
    return gather_tokens(wq, order), wpos.gather(1, order), wvalid.gather(1, order)


def push_one(
    win_q: torch.Tensor, win_pos: torch.Tensor, win_valid: torch.Tensor, query: torch.Tensor, position: torch.Tensor,
    ok: torch.Tensor,
) -> None:  # fmt: skip
    """One query per row (B, Hq, 1, D) at ``position`` (B,), where ``ok`` (B,): in place, with
    fixed shapes (a decode step)."""

    def roll(window, new, dim, cond):
        rolled = torch.cat([window.narrow(dim, 1, window.shape[dim] - 1), new.to(window.dtype)], dim)
        return torch.where(cond, rolled, window)

    win_q.copy_(roll(win_q, query, 2, ok[:, None, None, None]))
    win_pos.copy_(roll(win_pos, position[:, None], 1, ok[:, None]))
    win_valid.copy_(roll(win_valid, ok[:, None], 1, ok[:, None]))

"""The chunk table: per row, each kept chunk's logical index and where its keys and its
values lie (tier and slot in the tier pools, :mod:`hqekv.cache.pools`).

Tables are (B, C) int64, compacted to the left, -1 where empty; evicted chunks are gone. A
static cache keeps empty columns for chunks to come (:meth:`ChunkTable.live` drops them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tiers import FP16
from .rows import Capacity, RowPart


def column_major(table: torch.Tensor) -> torch.Tensor:
    """A (B, C) table with strides (1, B): the same values, its width C in no stride."""
    b, c = table.shape
    if table.stride() == (1, b):
        return table
    out = torch.empty_strided((b, c), (1, b), dtype=table.dtype, device=table.device)
    return out.copy_(table)


@dataclass
class ChunkTable(RowPart):
    """Per row (B, C): each kept chunk's logical index, and the tier and slot of its keys and
    of its values."""

    chunk_pos: torch.Tensor
    k_tier: torch.Tensor
    k_slot: torch.Tensor
    v_tier: torch.Tensor
    v_slot: torch.Tensor

    PART = "tables"

    @staticmethod
    def empty(rows: int, device: torch.device) -> "ChunkTable":
        none = torch.full((rows, 0), -1, dtype=torch.long, device=device)
        return ChunkTable(none, none.clone(), none.clone(), none.clone(), none.clone())

    @property
    def width(self) -> int:
        return self.chunk_pos.shape[1]

    def kept(self) -> torch.Tensor:
        """The entries that hold a chunk (B, C) bool."""
        return self.chunk_pos >= 0

    def live(self) -> "ChunkTable":
        """This table without the empty columns a static cache keeps for chunks to come
        (views; one host read: eager code)."""
        width = int(self.kept().sum(1).max()) if self.chunk_pos.numel() else 0
        if width == self.width:
            return self
        return ChunkTable(*(t[:, :width] for t in self.tensors()))

    def live_nbytes(self) -> int:
        """Bytes of the columns in use (the rest is a static cache's reserve)."""
        return self.live().nbytes()

    def resize(self, width: int) -> None:
        """Exactly ``width`` columns (new tensors): new columns empty, only empty ones dropped."""
        w = self.width
        if width > w:
            self._replace(torch.nn.functional.pad(t, (0, width - w), value=-1) for t in self.tensors())
        elif width < w:
            # own storage, so the wider tables are freed (their layout for compiled steps: mark_dynamic)
            self._replace(t[:, :width].clone() for t in self.tensors())

    def widen(self, width: int, capacity: Capacity) -> None:
        """At least ``width`` columns, as ``capacity`` sizes them."""
        if width > self.width:
            self.resize(capacity.room(self.width, width))

    def append_fp16(self, ok: torch.Tensor, n_chunks: torch.Tensor, slots_k: torch.Tensor, slots_v: torch.Tensor,
                    capacity: Capacity) -> None:  # fmt: skip
        """New FP16 chunks where ``ok`` (B, F), after each row's kept ones: logical index
        ``n_chunks`` (B,) on, their keys and values at ``slots_k``, ``slots_v`` (one per
        True of ``ok``, in row-major order)."""
        rows, cols = ok.nonzero(as_tuple=True)
        n_phys = self.kept().sum(1)
        self.widen(int((n_phys + ok.sum(1)).max()), capacity)
        dest = n_phys[rows] + cols
        for table, value in zip(self.tensors(), (n_chunks[rows] + cols, FP16, slots_k, FP16, slots_v)):
            table[rows, dest] = value

    def assign(self, other: "ChunkTable", capacity: Capacity) -> None:
        """Hold ``other``'s entries in this table's own tensors (widened if they lack room),
        the columns beyond them empty: every address stays (a static cache)."""
        self.widen(other.width, capacity)
        for own, new in zip(self.tensors(), other.tensors()):
            own.fill_(-1)
            own[:, : new.shape[1]] = new

    def mark_dynamic(self) -> None:
        """Tell ``torch.compile`` that the width varies (:meth:`HqeKVLayer._mark_for_compile`):
        column-major, so that the width is in no stride, and marked unbacked."""
        self._replace(column_major(t) for t in self.tensors())
        for t in self.tensors():
            torch._dynamo.decorators.mark_unbacked(t, 1)

    def _replace(self, tensors) -> None:
        self.chunk_pos, self.k_tier, self.k_slot, self.v_tier, self.v_slot = tensors

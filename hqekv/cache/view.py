"""A layer's storage as one view (:class:`CacheView`): the chunk pools read through the
chunk table, and the FP16 tail. Attention of new tokens over it (``hqekv::mixed_attention``)
and the same view dequantized (``hqekv::gather_chunks``) for importance scoring and
re-quantization.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import kernels
from ..tiers import FP16, TILE_CHUNKS
from .pools import KEY, VALUE, ComponentPools
from .table import ChunkTable
from .tail import Tail


class CacheView(NamedTuple):
    """What a layer stores, read together: per component its
    :class:`~hqekv.cache.pools.ComponentPools`, the :class:`~hqekv.cache.table.ChunkTable`
    pointing into them, the :class:`~hqekv.cache.tail.Tail`, and the value channel group
    the quantized values were made with."""

    pools: dict[str, ComponentPools]
    table: ChunkTable
    tail: Tail
    value_group: int

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, new_valid: torch.Tensor,
               scaling: float) -> torch.Tensor:  # fmt: skip
        """Attention of the new queries (B, Hq, S, D) over the view and the new keys/values
        (B, Hkv, S, D), causal among the new tokens, padding (``new_valid`` False) masked.
        -> (B, S, Hq, D)."""
        return kernels.attend(query, key, value, new_valid, self.packed(), scaling)

    def packed(self) -> kernels.PackedCache:
        """The view as the attention op reads it."""
        t, tail = self.table, self.tail
        return kernels.PackedCache(
            self.pools[KEY].op_order(), self.pools[VALUE].op_order(), t.k_tier, t.k_slot, t.v_tier, t.v_slot,
            tail.k, tail.v, tail.length, self.value_group,
        )  # fmt: skip

    def _gather(self, component: str, tier: torch.Tensor, slot: torch.Tensor, dtype: torch.dtype,
                tail: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        return kernels.gather_chunks(
            self.pools[component].op_order(), tier, slot, component == KEY, self.value_group, dtype, tail
        )

    def dequantized(self, n_chunks: torch.Tensor, dtype: torch.dtype):
        """The kept tokens, dequantized: chunks in table order, then the tail.

        ``n_chunks`` (B,): the chunks each row has had (the tail's logical chunk index).
        -> keys, values (B, H, C·G + G, D) ``dtype``, positions (B, C·G + G) int64 (index of
        each token within its sequence), valid (B, C·G + G) bool.
        """
        table, tail = self.table, self.tail
        g = tail.k.shape[2]
        b, c = table.chunk_pos.shape
        keys = self._gather(KEY, table.k_tier, table.k_slot, dtype, tail.k)
        values = self._gather(VALUE, table.v_tier, table.v_slot, dtype, tail.v)
        ar = torch.arange(g, device=table.chunk_pos.device)
        positions = torch.cat([(table.chunk_pos[:, :, None] * g + ar).reshape(b, c * g), n_chunks[:, None] * g + ar], 1)
        return keys, values, positions, kernels.cached_tokens(table.kept(), tail.length, g)

    def dequantized_tiles(self, n_chunks: torch.Tensor, dtype: torch.dtype, values: bool = True,
                          tile: int = TILE_CHUNKS):  # fmt: skip
        """:meth:`dequantized`, ``tile`` table columns at a time, the tail last: a pass over a
        layer whose transient memory is a tile's, however long the cache.

        Yields (start, keys, values, positions, valid) per tile: start the first table column
        (C for the tail), keys and values (B, H, n, D) ``dtype`` (values None unless
        ``values``), positions (B, n) int64 and valid (B, n) bool, the same tokens as the
        corresponding columns of :meth:`dequantized`.
        """
        table, tail = self.table, self.tail
        g = tail.k.shape[2]
        b, c = table.chunk_pos.shape
        ar = torch.arange(g, device=table.chunk_pos.device)
        for c0 in range(0, c, tile):
            cols = slice(c0, c0 + tile)
            chunk_pos = table.chunk_pos[:, cols]
            yield (
                c0,
                self._gather(KEY, table.k_tier[:, cols], table.k_slot[:, cols], dtype),
                self._gather(VALUE, table.v_tier[:, cols], table.v_slot[:, cols], dtype) if values else None,
                (chunk_pos[:, :, None] * g + ar).reshape(b, -1),
                (chunk_pos >= 0).repeat_interleave(g, 1),
            )
        yield (
            c, tail.k.to(dtype), tail.v.to(dtype) if values else None, n_chunks[:, None] * g + ar,
            ar[None, :] < tail.length[:, None],
        )  # fmt: skip

    def chunk_reader(self, dtype: torch.dtype):
        """-> read(component, rows, cols): the table entries (rows, cols) (n,) of ``component``
        dequantized, (n, H, G, D) ``dtype``, as :meth:`dequantized` holds them
        (:func:`hqekv.cache.rerank.rebuild` re-quantizes from it)."""
        table = self.table

        def read(component: str, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            tier, slot = (table.k_tier, table.k_slot) if component == KEY else (table.v_tier, table.v_slot)
            tier, slot = tier[rows, cols], slot[rows, cols]
            fp = self.pools[component].fp
            if bool((tier == FP16).all()):  # a prompt's new chunks: their slots, as stored
                return fp[slot].to(dtype)
            h, g, d = fp.shape[1:]
            out = self._gather(component, tier[None], slot[None], dtype)
            return out[0].reshape(h, rows.numel(), g, d).transpose(0, 1)

        return read

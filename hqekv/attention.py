"""Attention over a layer's cache view: the chunk pools read through the chunk tables, the
FP16 tail, and the new tokens (``hqekv::mixed_attention``); and the same view dequantized
(``hqekv::gather_chunks``) for importance scoring and re-quantization.

A view is what a layer holds: per component its :class:`~hqekv.pools.ComponentPools`, the
chunk table (:class:`~hqekv.rerank.ChunkTable`) and the tail (B, H, G, D) with its length (B,).
"""

from __future__ import annotations

import torch

from . import kernels
from .pools import KEY, VALUE, ComponentPools
from .rerank import ChunkTable
from .tiers import TILE_CHUNKS


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    new_valid: torch.Tensor,
    pools: dict[str, ComponentPools],
    table: ChunkTable,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_len: torch.Tensor,
    scaling: float,
    value_group: int,
) -> torch.Tensor:
    """Attention of the new queries (B, Hq, S, D) over the view and the new keys/values
    (B, Hkv, S, D), causal among the new tokens, padding (``new_valid`` False) masked.
    -> (B, S, Hq, D)."""
    return kernels.call(
        kernels.mixed_attention, query, key, value, new_valid, pools[KEY].op_order(), pools[VALUE].op_order(),
        table.k_tier, table.k_slot, table.v_tier, table.v_slot, tail_k, tail_v, tail_len, scaling, value_group,
    )  # fmt: skip


def dequantized(
    pools: dict[str, ComponentPools],
    table: ChunkTable,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_len: torch.Tensor,
    n_chunks: torch.Tensor,
    chunk_size: int,
    value_group: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept tokens, dequantized: chunks in table order, then the tail.

    -> keys, values (B, H, C·G + G, D) ``dtype``, positions (B, C·G + G) int64 (index of
    each token within its sequence), valid (B, C·G + G) bool.
    """
    g = chunk_size
    b, c = table.chunk_pos.shape
    out = [
        kernels.gather_chunks(pools[component].op_order(), tier, slot, component == KEY, value_group, dtype, tail)
        for component, tier, slot, tail in (
            (KEY, table.k_tier, table.k_slot, tail_k),
            (VALUE, table.v_tier, table.v_slot, tail_v),
        )
    ]
    ar = torch.arange(g, device=table.chunk_pos.device)
    positions = torch.cat([(table.chunk_pos[:, :, None] * g + ar).reshape(b, c * g), n_chunks[:, None] * g + ar], dim=1)
    return out[0], out[1], positions, kernels.cached_tokens(table.chunk_pos >= 0, tail_len, g)


def dequantized_tiles(
    pools: dict[str, ComponentPools],
    table: ChunkTable,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_len: torch.Tensor,
    n_chunks: torch.Tensor,
    chunk_size: int,
    value_group: int,
    dtype: torch.dtype,
    values: bool = True,
    tile: int = TILE_CHUNKS,
):
    """:func:`dequantized`, ``tile`` table columns at a time, the tail last: a pass over a
    layer whose transient memory is a tile's, however long the cache.

    Yields (start, keys, values, positions, valid) per tile: start the first table column
    (C for the tail), keys and values (B, H, n, D) ``dtype`` (values None unless
    ``values``), positions (B, n) int64 and valid (B, n) bool, the same tokens as the
    corresponding columns of :func:`dequantized`.
    """
    g = chunk_size
    b, c = table.chunk_pos.shape
    ar = torch.arange(g, device=table.chunk_pos.device)

    def read(component: str, tier: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        return kernels.gather_chunks(pools[component].op_order(), tier, slot, component == KEY, value_group, dtype)

    for c0 in range(0, c, tile):
        cols = slice(c0, c0 + tile)
        chunk_pos = table.chunk_pos[:, cols]
        yield (
            c0,
            read(KEY, table.k_tier[:, cols], table.k_slot[:, cols]),
            read(VALUE, table.v_tier[:, cols], table.v_slot[:, cols]) if values else None,
            (chunk_pos[:, :, None] * g + ar).reshape(b, -1),
            (chunk_pos >= 0).repeat_interleave(g, 1),
        )
    yield (
        c, tail_k.to(dtype), tail_v.to(dtype) if values else None, n_chunks[:, None] * g + ar, ar[None, :] < tail_len[:, None]
    )  # fmt: skip


def read_chunks(
    pools: dict[str, ComponentPools], table: ChunkTable, value_group: int, dtype: torch.dtype
):
    """-> read(component, rows, cols): the table entries (rows, cols) (n,) of ``component``
    dequantized, (n, H, G, D) ``dtype``, as :func:`dequantized` holds them
    (:func:`hqekv.rerank.rebuild` re-quantizes from it)."""

    def read(component: str, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        tier, slot = (table.k_tier, table.k_slot) if component == KEY else (table.v_tier, table.v_slot)
        fp = pools[component].fp
        h, g, d = fp.shape[1:]
        out = kernels.gather_chunks(
            pools[component].op_order(), tier[rows, cols][None], slot[rows, cols][None], component == KEY,
            value_group, dtype,
        )  # fmt: skip
        return out[0].reshape(h, rows.numel(), g, d).transpose(0, 1)

    return read

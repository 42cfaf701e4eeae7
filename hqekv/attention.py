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

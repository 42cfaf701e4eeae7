"""A layer's bytes as the rate-distortion allocator counts them (``allocation="rate-distortion"``):
what ``bavg`` comes to per row, what one chunk costs at each tier, and what the chunks
hold now — real bytes of codes and metadata, the same ones the memory report counts."""

from __future__ import annotations

import torch

from .. import allocation
from ..tiers import QUANTIZED_TIERS
from .pools import KEY, VALUE


def fair_budget(layer) -> torch.Tensor:
    """Bytes per row that ``bavg`` bits per element of every chunk the row has seen (evicted
    ones included) come to (B,) float64: ``layer``'s part of the model's budget when the
    layers share it evenly."""
    elements = 2 * layer.num_kv_heads * layer.config.chunk_size * layer.head_dim
    return layer.counters.n_chunks.double() * layer.config.bavg / 8 * elements


def chunk_bytes(layer, held: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Real bytes of one chunk's keys and of its values at each kept tier (:func:`hqekv.allocation.chunk_bytes`):
    at each tier's own width, what placing a chunk there costs, or with ``held`` at the
    width its pool holds now (a prompt's waiting keys: :data:`~hqekv.tiers.WIDE_BITS`)."""
    pools = layer.pools[KEY]
    widths = tuple({t: layer.pools[c].bits(t) for t in QUANTIZED_TIERS} for c in (KEY, VALUE)) if held else None
    return allocation.chunk_bytes(
        layer.num_kv_heads, layer.config.chunk_size, layer.head_dim, layer.value_group,
        pools.fp.element_size(), pools.quantized[QUANTIZED_TIERS[0]].meta0.element_size(), pools.fp.device, widths,
    )  # fmt: skip


def held_bytes(layer) -> torch.Tensor:
    """Real bytes each row's chunks hold at their tiers, codes and metadata (B,) float64."""
    table = layer.live_table()
    return allocation.tier_bytes(table.k_tier, table.v_tier, *chunk_bytes(layer, held=True))

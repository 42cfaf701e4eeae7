"""The room of a static cache (:class:`~hqekv.cache.rows.StaticCapacity`): how many pool
slots per tier and table columns ``max_length`` tokens need, and reserving them."""

from __future__ import annotations

import torch

from .. import policy
from ..tiers import EVICTED, FP16, KEY, QUANTIZED_TIERS, VALUE


def planned_room(layer) -> tuple[dict[str, dict[int, int]], int]:
    """Slots per component and tier, and the chunk-table width, that ``max_length`` tokens
    in every row need under this layer's ratios: the policy's tier counts at that length;
    in FP16 also the protected chunks and the chunks flushed since the last re-rank (a
    re-rank comes at the first flush ``rerank_interval`` tokens after the one before);
    two chunks of rounding per quantized tier (chunks only move down, so a tier can hold
    a chunk or two beyond its count). Under ``allocation="rate-distortion"`` there are no
    shares: each tier's count is its share of the chunks now, scaled to that length."""
    cfg = layer.config
    g = cfg.chunk_size
    n = -(-layer.max_length // g)  # chunks of the longest row
    flushed = -(-cfg.rerank_interval // g) + 1
    rankable = torch.tensor([max(n - cfg.protected_chunks, 0)])
    counts = {VALUE: policy.tier_counts(rankable, cfg.ratios)[0].tolist()}
    counts[KEY] = policy.tier_counts(rankable, cfg.key_ratios)[0].tolist() if cfg.key_ratios else counts[VALUE]
    b = layer.batch_size
    if cfg.allocation == "rate-distortion":
        # no shares to plan from: each tier keeps the share of the chunks it holds now
        seen = max(int(layer.counters.n_chunks.max()), 1)
        kept = layer.table.kept()
        for component, tiers in ((KEY, layer.table.k_tier), (VALUE, layer.table.v_tier)):
            held = [int((kept & (tiers == t)).sum()) for t in (FP16, *QUANTIZED_TIERS)]
            counts[component] = [-(-h * n // (seen * b)) for h in held] + [n - -(-sum(held) * n // (seen * b))]
    slots = {
        c: {
            FP16: b * (counts[c][FP16] + cfg.protected_chunks + flushed),
            **{t: b * (counts[c][t] + 2) for t in QUANTIZED_TIERS},
        }
        for c in (KEY, VALUE)
    }
    return slots, min(n, n - counts[VALUE][EVICTED] + flushed)


def reserve(layer, room: tuple[dict[str, dict[int, int]], int]) -> None:
    """Pools and tables sized to ``room`` (from :func:`planned_room`), or to what is in use
    where that is more (an input stores all its chunks in FP16 before re-ranking moves
    them down: the room it took is given back)."""
    slots, width = room
    for component, by_tier in slots.items():
        pools = layer.pools[component]
        for t, n in by_tier.items():
            n = max(n, pools.used[t])
            if n != pools.capacity(t):
                pools.resize(t, n)
    layer.table.resize(max(width, layer.live_table().width))

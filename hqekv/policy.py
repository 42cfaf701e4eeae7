"""Ratios -> tier counts -> K and V tier of every chunk (paper §3.3, SPEC §1.3)."""

from __future__ import annotations

import torch

from .config import TierRatios
from .tiers import EVICTED, FP16, INT1, INT2, INT4


def tier_counts(n_chunks: torch.Tensor, ratios: TierRatios) -> torch.Tensor:
    """Chunks per tier for ``n_chunks`` rankable chunks.

    n_chunks (B,) int -> counts (B, 5) int64 in tier order (fp16, int4, int2, int1, evicted),
    summing to ``n_chunks``. Each count is ``round(n·δ)`` and the 1-bit tier takes the
    leftover; when rounding overshoots, the tiers that were rounded up the most give one
    chunk back, so no count goes below 0 or moves more than one chunk from ``n·δ``.
    """
    n = n_chunks.to(torch.float64).clamp(min=0)
    shares = torch.tensor(ratios.as_tuple(), dtype=torch.float64, device=n_chunks.device)
    exact = n[:, None] * shares[None, :]
    counts = torch.round(exact)
    counts[:, INT1] = 0
    excess = counts.sum(1) - n  # > 0 when rounding overshot
    overshoot = counts - exact
    overshoot[:, INT1] = -float("inf")
    order = overshoot.argsort(dim=1, descending=True, stable=True)
    # Give back one chunk from each of the `excess` most over-rounded tiers.
    give = (torch.arange(5, device=n.device)[None, :] < excess[:, None]).to(torch.float64)
    counts = counts.scatter_add(1, order, -give)
    counts[:, INT1] = n - counts.sum(1)
    return counts.to(torch.int64)


def descending_rank(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rank of each chunk by score, 0 = most important; invalid entries rank last.

    scores (B, C) float, valid (B, C) bool -> rank (B, C) int64.
    """
    s = scores.masked_fill(~valid, -float("inf"))
    order = s.argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(s.shape[1], device=s.device).expand_as(order))
    return ranks


def assign_tiers(
    score_k: torch.Tensor,
    score_v: torch.Tensor,
    valid: torch.Tensor,
    ratios: TierRatios,
    n_logical: torch.Tensor | None = None,
    n_evicted: torch.Tensor | None = None,
    protected: int = 2,
    eviction: str = "joint",
    fp16_k: torch.Tensor | None = None,
    fp16_v: torch.Tensor | None = None,
    key_ratios: TierRatios | None = None,
    floor_k: torch.Tensor | None = None,
    floor_v: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tier of each chunk for K and for V; one evicted set shared by both.

    score_k, score_v (B, C) float: chunk importance under metric_K, metric_V.
    valid (B, C) bool: which entries are chunks.
    n_logical (B,) int: chunks seen by each sequence, evicted ones included (default: valid count);
        ratios apply to ``n_logical - protected`` of them.
    n_evicted (B,) int: chunks already evicted, counted against the eviction share.
    -> k_tier, v_tier (B, C) int64 in {FP16, INT4, INT2, INT1, EVICTED}; EVICTED at the same
       places in both; invalid entries are EVICTED.

    fix (K/V consistency): a chunk is evicted when it ranks low under both metrics
    (``eviction="joint"``: lowest ``max`` of its two percentiles, i.e. highest ``min`` of its
    two ranks); the top ``protected`` chunks under either metric are never evicted and are
    FP16 in their component. Kept chunks take K tiers in metric_K order and V tiers in
    metric_V order, with the same counts.

    fp16_k, fp16_v (B, C) bool: chunks still in FP16 in each component (default: all). During
    decode tiers only move down, so the ``protected`` FP16 chunks of a component are the top
    ones among those still in FP16: the newest chunk can take over from an older one, and
    the cache keeps its FP16 chunks instead of eroding them re-rank after re-rank.

    key_ratios: the keys' tier shares when they differ from the values' (``ratios``); the
    evicted count comes from ``ratios`` (one evicted set), so a key count that rounds
    differently moves one chunk between the keys' 1-bit tier and its neighbour.

    floor_k, floor_v (B, C) int: each chunk's current tier in its component, below which it
    cannot rise (tiers only move down). A tier's places go to the best-ranked kept chunks
    that can still be at it, so a chunk held lower by an earlier re-rank does not leave
    its place empty: the counts, and so the bytes, are those of the ratios. Default: none.
    """
    n_valid = valid.sum(1)
    if n_logical is None:
        n_logical = n_valid
    if n_evicted is None:
        n_evicted = torch.zeros_like(n_valid)
    rank_k = descending_rank(score_k, valid)
    rank_v = descending_rank(score_v, valid)

    rankable = (n_logical - protected).clamp(min=0)
    counts = tier_counts(rankable, ratios)
    counts_k = counts if key_ratios is None else tier_counts(rankable, key_ratios)

    def top_fp16(scores: torch.Tensor, fp16: torch.Tensor | None) -> torch.Tensor:
        candidates = valid if fp16 is None else valid & fp16
        return candidates & (descending_rank(scores, candidates) < protected)

    forced_k, forced_v = top_fp16(score_k, fp16_k), top_fp16(score_v, fp16_v)
    is_protected = valid & ((rank_k < protected) | (rank_v < protected) | forced_k | forced_v)

    # --- one evicted set -----------------------------------------------------------------
    if eviction == "joint":
        evict_key = torch.minimum(rank_k, rank_v)
    elif eviction == "key":
        evict_key = rank_k
    elif eviction == "value":
        evict_key = rank_v
    else:
        raise ValueError(f"eviction must be 'joint', 'key' or 'value', got {eviction!r}")
    candidate = valid & ~is_protected
    evict_key = evict_key.masked_fill(~candidate, -1)
    # Higher key = less important; stable sort keeps the older chunk first among ties.
    evict_rank = descending_rank(evict_key.to(torch.float64), candidate)
    n_evict = (counts[:, EVICTED] - n_evicted).clamp(min=0)
    n_evict = torch.minimum(n_evict, candidate.sum(1))
    evicted = candidate & (evict_rank < n_evict[:, None])
    kept = valid & ~evicted

    # --- tiers of the kept chunks, per metric ----------------------------------------------
    def tiers_for(scores: torch.Tensor, forced: torch.Tensor, c: torch.Tensor, floor) -> torch.Tensor:
        # The forced FP16 chunks take the first `protected` places, then the order of the metric.
        order = scores.float().masked_fill(forced, float("inf"))
        if floor is None:
            # Cumulative boundaries in kept-rank space: protected FP16, then fp16, int4, int2 counts.
            bounds = protected + c[:, [FP16, INT4, INT2]].cumsum(1)  # (B, 3)
            kept_rank = descending_rank(order, kept)  # (B, C)
            tier = (kept_rank[:, :, None] >= bounds[:, None, :]).sum(-1)  # 0..3
            return tier.masked_fill(~kept, EVICTED)
        tier = torch.full_like(floor, INT1)
        open_ = kept.clone()  # kept chunks without a place yet
        for t, places in ((FP16, protected + c[:, FP16]), (INT4, c[:, INT4]), (INT2, c[:, INT2])):
            can = open_ & (floor <= t)
            take = can & (descending_rank(order, can) < places[:, None])
            tier = tier.masked_fill(take, t)
            open_ &= ~take
        return tier.masked_fill(~kept, EVICTED)

    return tiers_for(score_k, forced_k, counts_k, floor_k), tiers_for(score_v, forced_v, counts, floor_v)

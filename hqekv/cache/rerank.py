"""Re-ranking, whole (SPEC §1.4): importance -> policy (or the allocator) -> rebuild.

- :func:`rerank`: a layer's re-rank of some rows, the steps below in order;
- :func:`dequantized_tiles`, :func:`window_tiles`: a re-rank's passes over a layer's cache,
  a tile at a time;
- :func:`chunk_scores`: each kept chunk's importance, by the configured scorer
  (:data:`SCORERS`: the K-V metric from the window queries, or the random control);
- :func:`allocator_choices`: what the rate-distortion allocator chooses from
  (``ratios="auto"``, :mod:`hqekv.allocation`);
- :func:`propose`: the tier the policy gives each kept chunk, from its importance scores;
- :func:`rebuild`: new pools and chunk tables for new tiers, chunks only moving down
  (FP16 → 4 → 2 → 1 bit → evicted), downgraded ones re-quantized from their dequantized
  values;
- :func:`place`: pools and tables that hold every chunk of an FP16 prefill at a given tier,
  from chunks encoded beforehand at every tier (calibration scores tier assignments this
  way without re-running the prefill).

The steps below :func:`rerank` keep no state: each takes tensors and returns tensors. The
layer (:class:`hqekv.cache.HqeKVLayer`) decides when to re-rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import allocation, importance, kernels, policy
from ..config import HqeKVConfig, TierRatios
from ..rotation import unrotate
from ..tiers import (EVICTED, FP16, INT1, INT2, INT4, QUANTIZED_TIERS, RERANK_TILE_CHUNKS, TIER_FORMATS, TILE_CHUNKS,
                     WIDE_BITS)
from . import budget
from .pools import KEY, VALUE, ComponentPools, QuantizedPool, encode_chunks
from .table import ChunkTable

WAITING = "int4"
"""Under fixed ratios, the tier a chunk waits at while eviction is deferred
(:data:`WAITING_TIERS`): "int4", at most 4 bits (the default), "above" the policy's, or
"at" it (ablations)."""


WAITING_TIERS = {
    "int4": torch.tensor([FP16, INT4, INT4, INT4, INT4]),
    "above": torch.tensor([FP16, INT4, INT4, INT2, INT2]),
    "at": torch.tensor([FP16, INT4, INT2, INT1, INT1]),
}
"""The tier a chunk waits at, indexed by the policy's tier (FP16, 4, 2, 1 bit, evicted), while
a prompt arrives in pieces and the question may still come (:data:`WAITING`).
"int4": FP16 where the policy keeps it, else 4 bits, so that nothing the prompt's last
queries may want is lost below 4 bits: the end of the prompt places every tier as a one-shot
prefill would (the same tier counts and bytes), at 4-bit storage until then. "above": one
tier above the policy's; early re-ranks that push chunks down one after another leave too
few at 4 bits for the end (on SmolLM2 at bavg 2, 9% fewer bytes than one-shot and a larger
loss). "at": the policy's tier, evicted chunks at 1 bit (the former behaviour)."""

WAITING_RECENT = 512
"""While a prompt arrives in pieces, the chunks among its newest ``WAITING_RECENT`` tokens
wait in FP16 instead of at 4 bits (:func:`newest_chunks`), under fixed ratios and the
allocator alike, and move down at the first re-rank after newer text arrives. The 4-bit
error the prompt's own tokens read during the prefill is what moves a chunked prompt's
answers away from one-shot's, and a piece reads the text just before it most; the cost is
fixed, 512 tokens in FP16 per layer whatever the prompt's length (``docs/results.md``,
"What moves the chunked answers"). 0: every chunk waits at 4 bits (the former rule)."""


WAITING_BITS = {KEY: WIDE_BITS, VALUE: TIER_FORMATS[INT4][0]}
"""While a prompt arrives in pieces, the width of each component's 4-bit pool: the keys
waiting there are stored at :data:`~hqekv.tiers.WIDE_BITS` bits, the values at 4, and
:meth:`~hqekv.cache.HqeKVCache.settle` narrows them to 4 bits (or lower) from those codes.
The 4-bit error of the earlier text a piece reads is what moves a chunked prompt's answers
away from one-shot's; the keys' share of it is most of it (``docs/results.md``, "Keys
waiting at 8 bits"). ``chunked_prefill="wait-4bit"`` keeps both at 4 (the former rule)."""


def waiting(tiers: torch.Tensor, how: str) -> torch.Tensor:
    """The tiers (B, C) chunks wait at under :data:`WAITING_TIERS` ``[how]``; -1 stays."""
    table = WAITING_TIERS[how].to(tiers.device)
    return torch.where(tiers >= 0, table[tiers.clamp(min=0)], tiers)


def propose(
    config: HqeKVConfig,
    score_k: torch.Tensor,
    score_v: torch.Tensor,
    table: ChunkTable,
    n_chunks: torch.Tensor,
    n_evicted: torch.Tensor,
    ratios: TierRatios,
    key_ratios: TierRatios | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's K and V tier (B, C) for every chunk of ``table`` from its scores (B, C),
    under ``ratios`` (the keys under ``key_ratios`` when given) and ``config``'s protected
    chunks and eviction rule."""
    return policy.assign_tiers(
        score_k,
        score_v,
        table.chunk_pos >= 0,
        ratios,
        n_logical=n_chunks,
        n_evicted=n_evicted,
        protected=config.protected_chunks,
        eviction=config.eviction,
        fp16_k=table.k_tier == FP16,
        fp16_v=table.v_tier == FP16,
        key_ratios=key_ratios,
        floor_k=table.k_tier.clamp(min=0),
        floor_v=table.v_tier.clamp(min=0),
    )


def rebuild(
    table: ChunkTable,
    pools: dict[str, ComponentPools],
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    read: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor],
    value_group: int,
    meta_dtype: torch.dtype,
    int4_bits: dict[str, int] | None = None,
) -> tuple[ChunkTable, dict[str, ComponentPools]]:
    """Pools and tables for new tiers (B, C); EVICTED entries are dropped.

    Chunks that keep their tier are copied slot to slot; downgraded ones are re-quantized
    from their dequantized values, ``read(component, rows, cols)`` -> (n, H, G, D) for the
    n table entries (rows, cols), asked for :data:`~hqekv.tiers.TILE_CHUNKS` at a time.
    Tiers never move up. ``int4_bits``: per component, the width of the new 4-bit pool
    (:data:`WAITING_BITS`); where it is not the old pool's, every chunk at 4 bits is
    re-quantized at it. None keeps each pool's width.
    """
    device = table.chunk_pos.device
    kept = (table.chunk_pos >= 0) & (new_k != EVICTED)
    new_slots, new_pools = {}, {}
    for component, old_tier, old_slot, new_tier in (
        (KEY, table.k_tier, table.k_slot, new_k),
        (VALUE, table.v_tier, table.v_slot, new_v),
    ):
        slot = torch.full_like(old_slot, -1)
        by_tier = {}
        for t in (FP16, *QUANTIZED_TIERS):
            at_t = kept & (new_tier == t)
            bits = pools[component].bits(t) if t != FP16 else None
            width = (int4_bits or {}).get(component, bits) if t == INT4 else bits
            same = at_t & (old_tier == t) & (width == bits)
            moved = at_t & ~same
            rs, cs = same.nonzero(as_tuple=True)
            rm, cm = moved.nonzero(as_tuple=True)
            slot[rs, cs] = torch.arange(rs.numel(), device=device)
            slot[rm, cm] = rs.numel() + torch.arange(rm.numel(), device=device)
            if t == FP16:
                if rm.numel():
                    raise AssertionError("a chunk moved up to FP16; tiers only move down")
                # index_select: an empty selection keeps a one-head pool's strides (compiled steps guard them)
                by_tier[t] = pools[component].fp.index_select(0, old_slot[rs, cs])
            else:
                # the new pool is written in place: the chunks that stay, then the moved ones
                # a batch at a time (quantizing's temporaries stay the size of a batch)
                old = pools[component].quantized[t].tensors()
                shaped = old if width == bits else encode_chunks(pools[component].fp[:0], t, component, value_group,
                                                                 meta_dtype, width).tensors()  # fmt: skip
                new = QuantizedPool(*(x.new_empty(rs.numel() + rm.numel(), *x.shape[1:]) for x in shaped))
                for into, source in zip(new.tensors(), old):
                    torch.index_select(source, 0, old_slot[rs, cs], out=into[: rs.numel()])
                start = rs.numel()
                for r, c in zip(rm.split(TILE_CHUNKS), cm.split(TILE_CHUNKS)):
                    fresh = encode_chunks(read(component, r, c), t, component, value_group, meta_dtype, width)
                    for into, source in zip(new.tensors(), fresh.tensors()):
                        into[start : start + r.numel()] = source
                    start += r.numel()
                by_tier[t] = new
        new_slots[component] = slot
        new_pools[component] = ComponentPools(by_tier[FP16], {t: by_tier[t] for t in QUANTIZED_TIERS})

    # Compact each row's kept chunks to the left, logical order preserved.
    b = kept.shape[0]
    width = int(kept.sum(1).max()) if b else 0
    dest = kept.long().cumsum(1) - 1
    rows, cols = kept.nonzero(as_tuple=True)
    compacted = []
    for source in (table.chunk_pos, new_k, new_slots[KEY], new_v, new_slots[VALUE]):
        out = torch.full((b, width), -1, dtype=torch.long, device=device)
        out[rows, dest[rows, cols]] = source[rows, cols]
        compacted.append(out)
    return ChunkTable(*compacted), new_pools


def place(
    chunk_pos: torch.Tensor,
    k_tier: torch.Tensor,
    v_tier: torch.Tensor,
    encoded: dict[str, dict[int, torch.Tensor | QuantizedPool]],
    fp_dtype: torch.dtype,
) -> tuple[ChunkTable, dict[str, ComponentPools], int]:
    """Tables and pools of one row whose chunks ``chunk_pos`` (1, C) sit at ``k_tier``/``v_tier`` (1, C).

    ``encoded[component][tier]`` holds every chunk at that tier: FP16 chunks (C, H, G, D) or
    a QuantizedPool of C slots. EVICTED (in ``k_tier``) drops a chunk from both components.
    Each tier's pool takes its chunks in table order, as :func:`rebuild` stores chunks that
    move down from FP16, so attention over the result is the attention over a cache that
    compressed the same prefill. -> (table, pools, chunks dropped).
    """
    kept = (chunk_pos[0] >= 0) & (k_tier[0] != EVICTED)
    index = kept.nonzero().flatten()
    tiers, slots, pools = {}, {}, {}
    for component, tier in ((KEY, k_tier[0, index]), (VALUE, v_tier[0, index])):
        slot = torch.full_like(tier, -1)
        by_tier = {}
        for t in (FP16, *QUANTIZED_TIERS):
            at = (tier == t).nonzero().flatten()
            slot[at] = torch.arange(at.numel(), device=slot.device)
            chunks = index[at]
            source = encoded[component][t]
            by_tier[t] = source.index_select(0, chunks).to(fp_dtype) if t == FP16 else source.select(chunks)
        tiers[component], slots[component] = tier[None], slot[None]
        pools[component] = ComponentPools(by_tier[FP16], {t: by_tier[t] for t in QUANTIZED_TIERS})
    table = ChunkTable(chunk_pos[:, index], tiers[KEY], slots[KEY], tiers[VALUE], slots[VALUE])
    return table, pools, int((~kept).sum())


HELD_TILE_BYTES = 2**24
"""A re-rank's passes over a layer share one dequantized copy of its cache when that copy
(keys and values) holds at most this many bytes (:class:`TileReader`): decode
re-ranks of short caches read the pools once instead of once per pass."""


def _finite(x: torch.Tensor) -> bool:
    """Whether ``x`` holds no NaN and no infinity (its extremes do: a NaN propagates to both)."""
    return x.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())


def dequantized_tiles(layer, values: bool = True, tile: int = RERANK_TILE_CHUNKS):
    """:meth:`hqekv.cache.view.CacheView.dequantized_tiles` of ``layer``, each tile checked:
    ``ValueError`` when it holds a NaN or an infinity (nothing can be ranked or quantized)."""
    view = layer.view(layer.live_table())
    for start, keys, vals, positions, valid in view.dequantized_tiles(layer.counters.n_chunks, layer.dtype, values,
                                                                     tile):  # fmt: skip
        if not (_finite(keys) and (vals is None or _finite(vals))):
            raise ValueError(
                f"non-finite (NaN/inf) key or value states in layer {layer.layer_idx}: they cannot be ranked or "
                "quantized"
            )
        yield start, keys, vals, positions, valid


class TileReader:
    """The dequantized tiles of a layer for the passes of one re-rank: ``reader(values=True)``
    -> an iterator of :func:`dequantized_tiles`' tuples. A cache of at most
    :data:`HELD_TILE_BYTES` dequantized is read once, as one tile, and every pass reuses
    it; a longer one is read again, a tile at a time, by each pass. ``held``: a tile's
    window visibility and logits by its start, kept by the first pass (:func:`window_lse`)
    for the next ones when the cache is held whole and those logits (float32, every query
    head's) fit :data:`HELD_TILE_BYTES` too; None when they are computed again by each pass."""

    def __init__(self, layer):
        self.layer = layer
        c = layer.live_table().width
        tokens = (c + 1) * layer.config.chunk_size
        dense = 2 * layer.batch_size * layer.num_kv_heads * tokens * layer.head_dim * layer.dtype.itemsize
        self.tiles = None if dense > HELD_TILE_BYTES else list(dequantized_tiles(layer, tile=max(c, 1)))
        b, hq, m, _ = layer.query_window.q.shape
        self.held = {} if self.tiles is not None and b * hq * m * tokens * 4 <= HELD_TILE_BYTES else None

    def __call__(self, values: bool = True):
        return iter(self.tiles) if self.tiles is not None else dequantized_tiles(self.layer, values)


def window_tiles(layer, lse: torch.Tensor | None = None, tiles: TileReader | None = None):
    """The window queries' probabilities over ``layer``'s cache, a tile at a time
    (:func:`hqekv.importance.window_tiles`): yields (start, keys, values, probs, visible);
    start is the tile's first table column, C for the tail. ``lse``: the softmax
    denominators of an earlier pass over the same cache and the same ``tiles`` (computed
    when not given); ``tiles``: a :class:`TileReader` (a new one when not given)."""
    tiles = tiles or TileReader(layer)
    if lse is None:
        lse = window_lse(layer, tiles)
    w = layer.query_window
    return importance.window_tiles(w.q, w.pos, w.valid, tiles(), layer.scaling, lse, tiles.held)


def window_lse(layer, tiles: TileReader | None = None) -> torch.Tensor:
    """Log of each window query's softmax denominator over ``layer``'s cache (B, Hkv, g, m)."""
    tiles = tiles or TileReader(layer)
    w = layer.query_window
    return importance.window_lse(w.q, w.pos, w.valid, tiles(False), layer.scaling, tiles.held)


def _score_tile(layer, scores: torch.Tensor, start: int, values, probs, visible) -> None:
    """Write the importance of one tile's chunks (:func:`window_tiles`) into ``scores``
    (2, B, C): keys' and values' scores of the table columns from ``start`` on; the tail's
    tile (start C) holds no chunk and is skipped."""
    g = layer.config.chunk_size
    if start < scores.shape[2]:
        nc = values.shape[2] // g
        scores[0, :, start : start + nc], scores[1, :, start : start + nc] = importance.chunk_importance_scores(
            probs, visible, unrotate(values, layer.rotation), nc, g
        )


def metric_scores(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The K-V importance of every kept chunk of ``layer`` from its window queries (SPEC §1.2).

    -> score_k, score_v (B, C) float32 in the order of its live table. The cache is read a
    tile at a time. The scores do not depend on ``config.rotation`` (beyond rounding): q·k is
    invariant and range(V) is taken in the model's basis.
    """
    chunk_pos = layer.live_table().chunk_pos
    scores = torch.zeros(2, *chunk_pos.shape, device=layer.device)
    for start, _, values, probs, visible in window_tiles(layer, tiles=TileReader(layer)):
        _score_tile(layer, scores, start, values, probs, visible)
    return scores[0], scores[1]


def random_scores(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The control: scores drawn at random for the kept chunks of ``layer``, seeded by its index."""
    return importance.random_scores(layer.live_table().chunk_pos, layer.layer_idx or 0)


SCORERS = {"attention": metric_scores, "random": random_scores}
"""Chunk scorers by ``config.importance``."""


def chunk_scores(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Each kept chunk's importance, (B, C) for keys and for values, by ``layer.config.importance``."""
    return SCORERS[layer.config.importance](layer)


def allocator_choices(layer, provisional: bool = False) -> "allocation.LayerChoices":
    """What the rate-distortion allocator chooses from (``allocation="rate-distortion"``,
    :mod:`hqekv.allocation`): the :class:`~hqekv.allocation.LayerChoices` of every chunk of
    ``layer``'s live table.

    The budget of a row is its share of ``bavg`` bits per element of all the chunks it has
    seen, evicted ones included (``provisional``: :data:`~hqekv.allocation.PROVISIONAL`
    times that); the top ``protected_chunks`` under either importance metric are never
    evicted. Three passes over the cache a tile at a time: the window's softmax
    denominators, the window outputs and importance, then the distortions.
    """
    cfg, g = layer.config, layer.config.chunk_size
    table = layer.live_table()
    b, c = table.chunk_pos.shape
    scores = torch.zeros(2, b, c, device=layer.device)  # keys', values' importance
    tiles = TileReader(layer)
    out, lse, seen = 0.0, window_lse(layer, tiles), 0
    for start, _, values, probs, visible in window_tiles(layer, lse, tiles):
        out = out + allocation.window_outputs(probs, values)
        seen = seen + visible.sum(-1)
        _score_tile(layer, scores, start, values, probs, visible)
    d_k, d_v = torch.zeros(2, b, c, 4, device=layer.device)
    d_evict = torch.zeros(b, c, device=layer.device)
    prior = allocation.DEFERRED_PRIOR if layer.deferring else allocation.PRIOR
    for start, keys, values, probs, visible in window_tiles(layer, lse, tiles):
        if start < c:
            cols = slice(start, start + values.shape[2] // g)
            d_k[:, cols], d_v[:, cols], d_evict[:, cols] = allocation.tile_distortions(
                allocation.with_prior(probs, visible, seen, prior), layer.query_window.q, keys, values, out, g, layer.scaling, layer.value_group, layer.meta_dtype,
                allocation.ERROR_MODEL, table.k_tier[:, cols], table.v_tier[:, cols],
            )  # fmt: skip
    d_k, d_v, d_evict = allocation.with_successors(d_k, d_v, d_evict, table.chunk_pos, allocation.NEXT_CHUNK)
    chunks = table.kept()
    if layer.split > 1 and allocation.HEAD_EVICTION == "chunk":
        # its heads are evicted together (their rows hold the same chunks, column by column):
        # the protected chunks are the most important ones over all heads, as with one row
        scores = scores.reshape(2, -1, layer.split, c).sum(2).repeat_interleave(layer.split, 1)
    evictable = chunks & ~protected(scores, chunks, cfg.protected_chunks)
    allowance = allocation.PROVISIONAL if provisional else 1.0
    row_budget = budget.fair_budget(layer) * layer.counters.budget_share * allowance
    energy = out.square().sum((1, 2, 3, 4))
    return allocation.LayerChoices(d_k, d_v, d_evict, table.k_tier, table.v_tier, evictable, row_budget, energy)


def protected(scores, chunks: torch.Tensor, n: int) -> torch.Tensor:
    """(B, C) bool: the chunks among ``chunks`` in the top ``n`` under either of the importance
    ``scores`` (keys', values', each (B, C)), which the allocator never evicts."""
    top = torch.zeros_like(chunks)
    for component_scores in scores:
        top |= chunks & (policy.descending_rank(component_scores, chunks) < n)
    return top


def waiting_at_int4(layer, table: ChunkTable) -> torch.Tensor:
    """Under the allocator while a prompt arrives in pieces (:data:`allocation.DEFERRED_WAIT`
    "int4"): the tier (B, C) each chunk of ``table`` waits at for the prompt's end, FP16 for
    the :func:`protected` chunks, 4 bits for every other chunk, as chunks wait under fixed
    ratios."""
    top = protected(chunk_scores(layer), table.kept(), layer.config.protected_chunks)
    return torch.where(top, FP16, INT4)


def newest_chunks(layer, table: ChunkTable, tokens: int) -> torch.Tensor:
    """(B, C) bool: the kept chunks of ``table`` (``layer``'s live table) among the newest
    ``tokens / chunk_size`` (rounded up) chunks of their row, the FP16 tail's tokens aside
    (none for 0)."""
    n = -(-tokens // layer.config.chunk_size)
    return table.kept() & (table.chunk_pos >= layer.counters.n_chunks[:, None] - n)


def rerank(layer, rows: torch.Tensor, provisional: bool = False) -> None:
    """Re-rank the chunks of ``rows`` (B,) bool of ``layer`` and move them down the tiers.

    Importance comes from the window queries over the current cache; chunks only move
    downward (FP16 → 4 → 2 → 1 → evicted), re-quantized from their dequantized values.
    While ``layer.deferring`` (a prompt in pieces), no chunk is evicted, and each chunk waits
    at the 4-bit tier (its keys at 8 bits, :data:`WAITING_BITS`) for
    :meth:`HqeKVCache.settle` unless the policy keeps it in FP16 (fixed ratios,
    :data:`WAITING`), it is protected (the allocator, :func:`waiting_at_int4`) or it is among
    the prompt's newest tokens (:data:`WAITING_RECENT`). Under
    ``allocation="rate-distortion"``, ``provisional`` (a multi-token input) keeps the layer
    within :data:`~hqekv.allocation.PROVISIONAL` times its budget and leaves its choices in
    ``layer.pending`` for :meth:`HqeKVCache.share_budget`.
    """
    table = layer.live_table()
    cfg = layer.config
    found = None
    if cfg.allocation == "rate-distortion" and layer.deferring and allocation.DEFERRED_WAIT == "int4":
        prop_k = prop_v = waiting_at_int4(layer, table)  # no budget is shared until settle
        prop_k = prop_v = torch.where(newest_chunks(layer, table, WAITING_RECENT), FP16, prop_k)
    elif cfg.allocation == "rate-distortion":
        found = allocator_choices(layer, provisional)
        if layer.deferring:
            found.evictable = torch.zeros_like(found.evictable)
        row = found.joined(layer.split)  # a row's heads share its budget (config.head_tiers)
        prop_k, prop_v = (allocation.split_rows(x, layer.split) for x in allocation.allocate(
            row.d_k, row.d_v, row.d_evict, *budget.chunk_bytes(layer), row.k_tier, row.v_tier, row.evictable,
            row.budget, group=row.group,
        ))  # fmt: skip
    else:
        score_k, score_v = chunk_scores(layer)
        counters = layer.counters
        prop_k, prop_v = propose(cfg, score_k, score_v, table, counters.n_chunks, counters.n_evicted, cfg.ratios,
                                 cfg.key_ratios)  # fmt: skip
        if layer.deferring:  # nothing is evicted, and each chunk waits at 4 bits at most for the prompt's end
            recent = newest_chunks(layer, table, WAITING_RECENT)
            prop_k = torch.where(recent, FP16, waiting(prop_k, WAITING))
            prop_v = torch.where(recent, FP16, waiting(prop_v, WAITING))
    here = rows[:, None] & table.kept()
    new_k = torch.where(here, prop_k, table.k_tier)
    new_v = torch.where(here, prop_v, table.v_tier)
    apply_tiers(layer, table, new_k, new_v)
    layer.counters.since_rerank.masked_fill_(rows, 0)
    if provisional and found is not None:
        new_k, new_v = torch.maximum(table.k_tier, new_k), torch.maximum(table.v_tier, new_v)
        kept = table.kept() & (new_k != EVICTED)
        layer.pending = found.kept(kept, new_k, new_v)


def apply_tiers(layer, table: ChunkTable, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
    """Move the chunks of ``table`` (``layer``'s live table) to ``new_k``, ``new_v`` (B, C),
    each at its tier or below; those that move are re-quantized from their dequantized
    values, a tile of them at a time."""
    new_k = torch.maximum(table.k_tier, new_k)
    new_v = torch.maximum(table.v_tier, new_v)
    evicted = table.kept() & (new_k == EVICTED)
    read = layer.view(table).chunk_reader(layer.dtype)
    narrow = TIER_FORMATS[INT4][0]
    wide = layer.deferring and layer.config.chunked_prefill == "wait"
    group_len = {KEY: layer.config.chunk_size, VALUE: layer.value_group}  # codes per quantization group
    int4_bits = {c: WAITING_BITS[c] if wide and kernels.holds_wide(group_len[c]) else narrow for c in (KEY, VALUE)}
    layer.set_chunks(*rebuild(table, layer.pools, new_k, new_v, read, layer.value_group, layer.meta_dtype, int4_bits))
    layer.counters.n_evicted += evicted.sum(1)

"""Re-ranking as pure steps (SPEC §1.4): importance -> policy -> re-quantize.

- :func:`propose`: the tier the policy gives each kept chunk, from its importance scores;
- :func:`rebuild`: new pools and chunk tables for new tiers, chunks only moving down
  (FP16 → 4 → 2 → 1 bit → evicted), downgraded ones re-quantized from their dequantized
  values;
- :func:`place`: pools and tables that hold every chunk of an FP16 prefill at a given tier,
  from chunks encoded beforehand at every tier (calibration scores tier assignments this
  way without re-running the prefill).

Nothing here keeps state: each takes tensors and returns tensors. The layer
(:class:`hqekv.cache.HqeKVLayer`) decides when to run them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from . import policy
from .config import HqeKVConfig, TierRatios
from .pools import KEY, VALUE, ComponentPools, QuantizedPool, encode_chunks
from .tiers import EVICTED, FP16, INT1, INT2, INT4, QUANTIZED_TIERS, TILE_CHUNKS


class ChunkTable(NamedTuple):
    """Per row (B, C), compacted to the left, -1 where empty: each kept chunk's logical
    index, and the tier and slot of its keys and of its values."""

    chunk_pos: torch.Tensor
    k_tier: torch.Tensor
    k_slot: torch.Tensor
    v_tier: torch.Tensor
    v_slot: torch.Tensor


WAITING_TIERS = {
    "int4": torch.tensor([FP16, INT4, INT4, INT4, INT4]),
    "above": torch.tensor([FP16, INT4, INT4, INT2, INT2]),
    "at": torch.tensor([FP16, INT4, INT2, INT1, INT1]),
}
"""The tier a chunk waits at, indexed by the policy's tier (FP16, 4, 2, 1 bit, evicted), while
a prompt arrives in pieces and the question may still come (:data:`hqekv.cache.WAITING`).
"int4": FP16 where the policy keeps it, else 4 bits, so that nothing the prompt's last
queries may want is lost below 4 bits: the end of the prompt places every tier as a one-shot
prefill would (the same tier counts and bytes), at 4-bit storage until then. "above": one
tier above the policy's; early re-ranks that push chunks down one after another leave too
few at 4 bits for the end (on SmolLM2 at bavg 2, 9% fewer bytes than one-shot and a larger
loss). "at": the policy's tier, evicted chunks at 1 bit (the former behaviour)."""


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
) -> tuple[ChunkTable, dict[str, ComponentPools]]:
    """Pools and tables for new tiers (B, C); EVICTED entries are dropped.

    Chunks that keep their tier are copied slot to slot; downgraded ones are re-quantized
    from their dequantized values, ``read(component, rows, cols)`` -> (n, H, G, D) for the
    n table entries (rows, cols), asked for :data:`~hqekv.tiers.TILE_CHUNKS` at a time.
    Tiers never move up.
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
            same = at_t & (old_tier == t)
            moved = at_t & (old_tier != t)
            rs, cs = same.nonzero(as_tuple=True)
            rm, cm = moved.nonzero(as_tuple=True)
            slot[rs, cs] = torch.arange(rs.numel(), device=device)
            slot[rm, cm] = rs.numel() + torch.arange(rm.numel(), device=device)
            if t == FP16:
                if rm.numel():
                    raise AssertionError("a chunk moved up to FP16; tiers only move down")
                by_tier[t] = pools[component].fp[old_slot[rs, cs]]
            else:
                # the new pool is written in place: the chunks that stay, then the moved ones
                # a batch at a time (quantizing's temporaries stay the size of a batch)
                old = pools[component].quantized[t].tensors()
                new = QuantizedPool(*(x.new_empty(rs.numel() + rm.numel(), *x.shape[1:]) for x in old))
                for into, source in zip(new.tensors(), old):
                    torch.index_select(source, 0, old_slot[rs, cs], out=into[: rs.numel()])
                start = rs.numel()
                for r, c in zip(rm.split(TILE_CHUNKS), cm.split(TILE_CHUNKS)):
                    fresh = encode_chunks(read(component, r, c), t, component, value_group, meta_dtype)
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
            by_tier[t] = source[chunks].to(fp_dtype) if t == FP16 else source.select(chunks)
        tiers[component], slots[component] = tier[None], slot[None]
        pools[component] = ComponentPools(by_tier[FP16], {t: by_tier[t] for t in QUANTIZED_TIERS})
    table = ChunkTable(chunk_pos[:, index], tiers[KEY], slots[KEY], tiers[VALUE], slots[VALUE])
    return table, pools, int((~kept).sum())

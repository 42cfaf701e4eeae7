"""The tier table: what each storage tier of a chunk is (SPEC §1.1, §1.3).

One row per tier, in the order of the tier ids, which is also the order chunks move
down at re-ranking (FP16 → 4 → 2 → 1 bit → evicted) and the order of
:class:`hqekv.TierRatios` (fp16, δ1, δ2, δ3, δ4). Everything that needs a tier's name,
bits or quantizer reads it here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    """id: the value in chunk tables; code_bits: bits per element as the paper counts them
    (SPEC eq. 6: FP16 16, evicted 0); method: the quantizer, None where nothing is quantized."""

    id: int
    name: str
    code_bits: int
    method: str | None

    @property
    def normalized(self) -> bool:
        """Codes are centres of a normal distribution scaled by std, shifted by mean (1 bit)."""
        return self.method == "normalized"


FP16, INT4, INT2, INT1, EVICTED = 0, 1, 2, 3, 4
TIERS = (
    Tier(FP16, "fp16", 16, None),
    Tier(INT4, "int4", 4, "uniform"),
    Tier(INT2, "int2", 2, "uniform"),
    Tier(INT1, "int1", 1, "normalized"),
    Tier(EVICTED, "evicted", 0, None),
)
QUANTIZED_TIERS = (INT4, INT2, INT1)
"""Tiers stored as packed codes plus a metadata pair per group, in pool order."""
TIER_NAMES = tuple(t.name for t in TIERS)
TIER_CODE_BITS = tuple(t.code_bits for t in TIERS)
TIER_FORMATS = {t: (TIERS[t].code_bits, TIERS[t].normalized) for t in QUANTIZED_TIERS}
"""Quantized tier -> (bits, normalized), the arguments of the quantize/dequantize kernels."""

WIDE_BITS = 8
"""The 4-bit tier's pools may hold codes of ``WIDE_BITS`` bits instead (uniform, the same
metadata): while a prompt arrives in pieces, the chunks of a component waiting there are
stored that wide (:data:`hqekv.cache.rerank.WAITING_BITS`) and narrowed at its end. A pool's
code words say which (:func:`hqekv.kernels.tier_formats`)."""

KEY, VALUE = "k", "v"
"""The two components a chunk is stored as, each at its own tier: keys and values."""

TILE_CHUNKS = 64
"""Chunks a streamed pass over a layer's storage holds dequantized at a time (the CPU
attention's tiles, re-quantization's batches in a re-rank, and
:func:`hqekv.kernels.gather_chunks`' batches): its transient memory is that of a tile
(2048 tokens at G = 32), not of the whole layer, however long the cache."""
RERANK_TILE_CHUNKS = 16
"""Chunks a re-rank's passes over a long cache read at a time (importance and the
allocator's distortions): their float32 temporaries (the window's probabilities, the
distortions' weights) are several times a tile's dequantized bytes, so their tiles are a
quarter of the attention's (Llama-3-8B's attention at 8K tokens: a layer's choices peak
at 25 MiB instead of 52, in the same time)."""

"""Per-component tier pools: the chunk slots of one component (keys or values) at each tier.

A layer keeps, for keys and for values, one pool per tier:

- FP16: slots (N, Hkv, G, D) in the cache's full-precision dtype;
- each quantized tier: a :class:`QuantizedPool` of packed int32 codes plus a metadata pair
  per group (keys: per-channel groups over the G tokens; values: per-token groups of
  channels).

A chunk table entry (tier, slot) points into them. This module encodes and decodes chunks
(``hqekv::quantize_pack`` / ``hqekv::dequantize``) and lists the pools in the order the
attention op takes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .tiers import FP16, QUANTIZED_TIERS, TIER_FORMATS, TIER_NAMES

KEY, VALUE = "k", "v"


@dataclass
class QuantizedPool:
    """Chunk slots of one component at one quantized tier.

    keys:   codes (N, H, D, ceil(G·b/32)) int32, meta0/meta1 (N, H, D)
    values: codes (N, H, G, D//g, ceil(g·b/32)) int32, meta0/meta1 (N, H, G, D//g)
    meta0/meta1 are scale/zero (uniform) or std/mean (normalized).
    """

    codes: torch.Tensor
    meta0: torch.Tensor
    meta1: torch.Tensor

    def select(self, slots: torch.Tensor) -> "QuantizedPool":
        return QuantizedPool(self.codes[slots], self.meta0[slots], self.meta1[slots])

    @staticmethod
    def cat(parts: list["QuantizedPool"]) -> "QuantizedPool":
        return QuantizedPool(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "meta0", "meta1")))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.meta0, self.meta1)


def encode_chunks(chunks: torch.Tensor, tier: int, component: str, value_group: int, meta_dtype: torch.dtype) -> QuantizedPool:
    """Quantize and pack chunks: (N, H, G, D) -> QuantizedPool at ``tier`` (``hqekv::quantize_pack``)."""
    bits, normalized = TIER_FORMATS[tier]
    return QuantizedPool(
        *kernels.call(kernels.quantize_pack, chunks, bits, normalized, component == KEY, value_group, meta_dtype)
    )


def decode_chunks(
    pool: QuantizedPool, tier: int, component: str, chunk_size: int, head_dim: int, value_group: int, dtype: torch.dtype
) -> torch.Tensor:
    """Unpack and dequantize: QuantizedPool at ``tier`` -> (N, H, G, D) ``dtype`` (``hqekv::dequantize``)."""
    bits, normalized = TIER_FORMATS[tier]
    return kernels.call(
        kernels.dequantize, *pool.tensors(), bits, normalized, component == KEY, value_group, chunk_size, head_dim, dtype
    )


@dataclass
class ComponentPools:
    """The pools of one component: FP16 slots and a :class:`QuantizedPool` per quantized tier."""

    fp: torch.Tensor
    quantized: dict[int, QuantizedPool]

    @staticmethod
    def empty(
        like: torch.Tensor, component: str, chunk_size: int, value_group: int, fp_dtype: torch.dtype,
        meta_dtype: torch.dtype,
    ) -> "ComponentPools":  # fmt: skip
        """No slots, shaped for (B, H, S, D) states ``like``."""
        none = like.new_zeros(0, like.shape[1], chunk_size, like.shape[3])
        return ComponentPools(
            none.to(fp_dtype), {t: encode_chunks(none, t, component, value_group, meta_dtype) for t in QUANTIZED_TIERS}
        )

    def op_order(self) -> list[torch.Tensor]:
        """The pools in ``hqekv::mixed_attention`` order: FP16, then codes, meta0, meta1 of each quantized tier."""
        return [self.fp, *(x for t in QUANTIZED_TIERS for x in self.quantized[t].tensors())]

    def tier(self, t: int) -> torch.Tensor | QuantizedPool:
        return self.fp if t == FP16 else self.quantized[t]

    def nbytes(self) -> dict[str, int]:
        """Real bytes per tier name."""
        return {
            TIER_NAMES[FP16]: self.fp.nbytes,
            **{TIER_NAMES[t]: sum(x.nbytes for x in self.quantized[t].tensors()) for t in QUANTIZED_TIERS},
        }

    def clone(self) -> "ComponentPools":
        return ComponentPools(self.fp.clone(), {t: QuantizedPool(*(x.clone() for x in p.tensors()))
                                                for t, p in self.quantized.items()})  # fmt: skip

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the pools hold (their bytes are the pools' memory)."""
        return self.op_order()

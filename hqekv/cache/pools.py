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

from dataclasses import dataclass, field

import torch

from .. import kernels
from ..tiers import FP16, KEY, QUANTIZED_TIERS, TIER_FORMATS, TIER_NAMES, VALUE
from .rows import Capacity


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
        if isinstance(slots, torch.Tensor) and slots.dtype != torch.bool:  # index_select: an empty selection keeps canonical strides
            return QuantizedPool(*(x.index_select(0, slots) for x in self.tensors()))
        return QuantizedPool(*(x[slots] for x in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.meta0, self.meta1)


def encode_chunks(
    chunks: torch.Tensor, tier: int, component: str, value_group: int, meta_dtype: torch.dtype, bits: int | None = None
) -> QuantizedPool:
    """Quantize and pack chunks: (N, H, G, D) -> QuantizedPool at ``tier`` (``hqekv::quantize_pack``),
    ``bits`` wide if given (:data:`~hqekv.tiers.WIDE_BITS` for the 4-bit tier), else the tier's own."""
    default_bits, normalized = TIER_FORMATS[tier]
    bits = bits or default_bits
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
    """The pools of one component: FP16 slots and a :class:`QuantizedPool` per quantized tier.

    ``used[t]``: slots of tier t in use, the first ones; a pool may hold more (its capacity,
    reserved for chunks to come in a static cache), which no chunk table points at.
    """

    fp: torch.Tensor
    quantized: dict[int, QuantizedPool]
    used: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        for t in (FP16, *QUANTIZED_TIERS):
            self.used.setdefault(t, self.capacity(t))

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

    def bits(self, t: int) -> int:
        """The width of quantized tier ``t``'s codes (:func:`hqekv.kernels.tier_formats`)."""
        return kernels.tier_formats(self.op_order())[t][0]

    def op_order(self) -> list[torch.Tensor]:
        """The pools in ``hqekv::mixed_attention`` order: FP16, then codes, meta0, meta1 of each quantized tier."""
        return [self.fp, *(x for t in QUANTIZED_TIERS for x in self.quantized[t].tensors())]

    def _parts(self, t: int) -> tuple[torch.Tensor, ...]:
        return (self.fp,) if t == FP16 else self.quantized[t].tensors()

    def in_use(self, t: int) -> torch.Tensor | QuantizedPool:
        """Tier ``t``'s slots in use (views)."""
        n = self.used[t]
        return self.fp[:n] if t == FP16 else QuantizedPool(*(x[:n] for x in self.quantized[t].tensors()))

    def capacity(self, t: int) -> int:
        """Slots tier ``t`` has room for."""
        return self._parts(t)[0].shape[0]

    def resize(self, t: int, slots: int) -> None:
        """Give tier ``t`` room for ``slots`` slots (new tensors), keeping the slots in use."""
        if slots < self.used[t]:
            raise ValueError(f"cannot shrink a pool to {slots} slots: {self.used[t]} are in use")
        parts = []
        for x in self._parts(t):
            y = x.new_zeros(slots, *x.shape[1:])
            y[: self.used[t]] = x[: self.used[t]]
            parts.append(y)
        if t == FP16:
            self.fp = parts[0]
        else:
            self.quantized[t] = QuantizedPool(*parts)

    def store(self, t: int, start: int, new: torch.Tensor | QuantizedPool, capacity: Capacity) -> None:
        """Write ``new`` (FP16 chunks (N, H, G, D), or a :class:`QuantizedPool` of N slots) into
        slots ``start`` … ``start + N − 1`` of tier ``t``, in place, and count them in use.

        Without room the tier grows first (new tensors), as ``capacity`` sizes it: a static
        cache by :data:`~hqekv.cache.rows.GROWTH` at least, so that growing is rare; others
        to exactly the slots needed. Codes of another width than the tier's (a prompt's
        waiting chunks at :data:`~hqekv.tiers.WIDE_BITS`, and back) replace its tensors,
        with as many slots.
        """
        if not 0 <= start <= self.used[t]:
            raise ValueError(f"slots are stored from {start}, but tier {t} has {self.used[t]} in use: no gaps")
        new_parts = (new,) if t == FP16 else new.tensors()
        if new_parts[0].shape[1:] != self._parts(t)[0].shape[1:]:  # codes of another width (WIDE_BITS)
            if start:
                raise ValueError(f"tier {t} changes width only when rewritten from its first slot, not from {start}")
            room = self.capacity(t)
            self.quantized[t] = QuantizedPool(*(y.new_zeros(room, *y.shape[1:]) for y in new_parts))
            self.used[t] = 0
        end = start + new_parts[0].shape[0]
        room = self.capacity(t)
        if end > room:
            self.used[t] = start  # the slots from start on are overwritten: the growth need not keep them
            self.resize(t, capacity.room(room, end))
        for x, y in zip(self._parts(t), new_parts):
            x[start:end] = y
        self.used[t] = max(self.used[t], end)

    def append_fp16(self, new: torch.Tensor, capacity: Capacity) -> torch.Tensor:
        """Store FP16 chunks ``new`` (N, H, G, D) after the FP16 slots in use (:meth:`store`)
        -> their slots (N,) int64."""
        start = self.used[FP16]
        self.store(FP16, start, new, capacity)
        return start + torch.arange(new.shape[0], device=new.device)

    def mark_dynamic(self) -> None:
        """Tell ``torch.compile`` that the pools' slot counts vary (:meth:`HqeKVLayer._mark_for_compile`)."""
        for t in self.op_order():
            torch._dynamo.decorators.mark_unbacked(t, 0)

    def nbytes(self) -> dict[str, int]:
        """Real bytes of the slots in use, per tier name."""
        return {
            TIER_NAMES[t]: sum(x[: self.used[t]].nbytes for x in self._parts(t)) for t in (FP16, *QUANTIZED_TIERS)
        }

    def reserve_nbytes(self) -> int:
        """Real bytes of the slots not in use (a static cache's room for chunks to come)."""
        return sum(x[self.used[t] :].nbytes for t in (FP16, *QUANTIZED_TIERS) for x in self._parts(t))

    def clone(self) -> "ComponentPools":
        return ComponentPools(self.fp.clone(), {t: QuantizedPool(*(x.clone() for x in p.tensors()))
                                                for t, p in self.quantized.items()}, dict(self.used))  # fmt: skip

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the pools hold (their bytes are the pools' memory)."""
        return self.op_order()

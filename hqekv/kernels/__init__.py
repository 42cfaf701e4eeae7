"""Kernels of the hot path, registered as ``hqekv::`` custom ops (``torch.ops.hqekv.*``).

- :func:`quantize_pack`: chunks -> packed codes + metadata (4/2-bit uniform, 1-bit normalized)
- :func:`dequantize`: the inverse
- :func:`mixed_attention`: attention of new queries over the whole mixed-tier cache

and two helpers of the dense view of a cache (eager PyTorch): :func:`gather_chunks`
(the chunks a table references, dequantized, in table order) and :func:`cached_tokens`.

``call(op, *args)`` (and, for ``mixed_attention``, ``attend(..., cache, scaling)`` with a
:class:`PackedCache`) runs an op as a graph node under ``torch.compile`` and straight to its
implementation in eager mode, as the one dispatch table :data:`~hqekv.kernels.ops.KERNELS`
says. Each ``kernels/<name>.py`` holds ``<name>_reference`` (pure PyTorch: what a device
without a kernel runs, and the test reference) beside the Triton kernel ``<name>_triton``
that CUDA tensors use; a CPU decode step of ``mixed_attention`` runs the fused C kernel of
:mod:`.mixed_attention_cpu`, registered in the table as the op's CPU implementation.
"""

from .mixed_attention import PackedCache, cached_tokens, gather_chunks, holds_wide, tier_formats
from .ops import attend, call, dequantize, mixed_attention, quantize_pack

__all__ = ["PackedCache", "attend", "cached_tokens", "call", "dequantize", "gather_chunks", "mixed_attention", "quantize_pack",
           "holds_wide", "tier_formats"]

"""Kernels of the hot path, registered as ``hqekv::`` custom ops (``torch.ops.hqekv.*``).

- :func:`quantize_pack`: chunks -> packed codes + metadata (4/2-bit uniform, 1-bit normalized)
- :func:`dequantize`: the inverse
- :func:`mixed_attention`: attention of new queries over the whole mixed-tier cache

and two helpers of the dense view of a cache (eager PyTorch): :func:`gather_chunks`
(the chunks a table references, dequantized, in table order) and :func:`cached_tokens`.

``call(op, *args)`` runs an op as a graph node under ``torch.compile`` and straight to its
implementation in eager mode. Each ``kernels/<name>.py`` holds ``<name>_reference`` (pure PyTorch: the CPU implementation
and the test reference) beside the Triton kernel ``<name>_triton`` that CUDA tensors use;
a CPU decode step of ``mixed_attention`` runs the fused C kernel of :mod:`.cpu` instead.
"""

from .mixed_attention import cached_tokens, gather_chunks
from .ops import call, dequantize, mixed_attention, quantize_pack

__all__ = ["cached_tokens", "call", "dequantize", "gather_chunks", "mixed_attention", "quantize_pack"]

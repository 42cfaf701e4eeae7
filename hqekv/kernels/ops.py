"""The ``hqekv::`` custom ops: schemas, fake (meta) implementations and device dispatch.

One table, :data:`KERNELS`, says what each op runs on each device: its Triton kernel on
CUDA, and on CPU for ``mixed_attention`` :func:`mixed_attention_on_cpu` (a decode step runs
the fused C kernel of :mod:`~hqekv.kernels.mixed_attention_cpu`); anything else runs the op's
pure-PyTorch reference (:data:`REFERENCES`). ``HQEKV_TRITON=0`` in the environment (read at import) makes
CUDA tensors use the references too; ``HQEKV_CPU_KERNEL=0``, CPU decode steps. The ops are
opaque to ``torch.compile``: the fakes give the output shapes, so a compiled graph holds
them without a graph break on any device.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

from . import mixed_attention_cpu as cpu
from ._triton import HAVE_TRITON
from .dequantize import dequantize_reference, dequantize_triton
from .mixed_attention import PackedCache, mixed_attention_reference, mixed_attention_triton, triton_fits
from .quantize_pack import packed_shapes, quantize_pack_reference, quantize_pack_triton


@torch.library.custom_op("hqekv::quantize_pack", mutates_args=())
def quantize_pack(
    x: Tensor, bits: int, normalized: bool, per_channel: bool, group: int, meta_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """Chunks (N, H, G, D) -> packed codes int32, meta0, meta1 (see :mod:`hqekv.kernels.quantize_pack`)."""
    return quantize_pack_reference(x, bits, normalized, per_channel, group, meta_dtype)


@quantize_pack.register_fake
def _(x, bits, normalized, per_channel, group, meta_dtype):
    codes_shape, meta_shape = packed_shapes(x.shape, bits, per_channel, group)
    return x.new_empty(codes_shape, dtype=torch.int32), x.new_empty(meta_shape, dtype=meta_dtype), x.new_empty(
        meta_shape, dtype=meta_dtype
    )


@torch.library.custom_op("hqekv::dequantize", mutates_args=())
def dequantize(
    codes: Tensor,
    meta0: Tensor,
    meta1: Tensor,
    bits: int,
    normalized: bool,
    per_channel: bool,
    group: int,
    chunk_size: int,
    head_dim: int,
    dtype: torch.dtype,
) -> Tensor:
    """Packed codes + metadata -> chunks (N, H, chunk_size, head_dim) ``dtype``."""
    out = dequantize_reference(codes, meta0, meta1, bits, normalized, per_channel, group, chunk_size, head_dim, dtype)
    return out.contiguous()


@dequantize.register_fake
def _(codes, meta0, meta1, bits, normalized, per_channel, group, chunk_size, head_dim, dtype):
    return codes.new_empty(codes.shape[0], codes.shape[1], chunk_size, head_dim, dtype=dtype)


@torch.library.custom_op("hqekv::mixed_attention", mutates_args=())
def mixed_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    new_valid: Tensor,
    scaling: float,
    k_pools: list[Tensor],
    v_pools: list[Tensor],
    k_tier: Tensor,
    k_slot: Tensor,
    v_tier: Tensor,
    v_slot: Tensor,
    tail_k: Tensor,
    tail_v: Tensor,
    tail_len: Tensor,
    value_group: int,
) -> Tensor:
    """Attention of query (B, Hq, S, D) over the mixed cache and the new tokens -> (B, S, Hq, D).

    The schema lays a :class:`~hqekv.kernels.mixed_attention.PackedCache` out flat, in its
    field order (an op takes no tuples); call it through :func:`attend`, which takes one.
    """
    cache = PackedCache(k_pools, v_pools, k_tier, k_slot, v_tier, v_slot, tail_k, tail_v, tail_len, value_group)
    return mixed_attention_reference(query, key, value, new_valid, cache, scaling).contiguous()


@mixed_attention.register_fake
def _(query, key, value, new_valid, scaling, *cache):
    b, hq, s, d = query.shape
    return query.new_empty(b, s, hq, d)


_warned_cpu = False


def mixed_attention_on_cpu(query, key, value, new_valid, cache: PackedCache, scaling: float) -> Tensor:
    """``mixed_attention`` on CPU: a decode step (one new token) runs the fused C kernel
    (:mod:`hqekv.kernels.mixed_attention_cpu`) when it is built; anything else, the PyTorch reference. A kernel
    that cannot be built is said once, in a warning, not skipped in silence."""
    global _warned_cpu
    if query.shape[2] == 1 and cpu.ENABLED and cpu.supports(query, cache):
        if cpu.library() is not None:
            return cpu.mixed_attention_cpu(query, key, value, new_valid, cache, scaling)
        if not _warned_cpu:
            _warned_cpu = True
            warnings.warn(
                f"hqekv: CPU decoding runs the PyTorch reference attention, several times slower than the fused "
                f"kernel, because {cpu.available()[1]}. HQEKV_CPU_KERNEL=0 chooses the reference and silences this.",
                RuntimeWarning,
                stacklevel=2,
            )
    return mixed_attention_reference(query, key, value, new_valid, cache, scaling)


def mixed_attention_cuda(query, key, value, new_valid, cache: PackedCache, scaling: float) -> Tensor:
    """``mixed_attention`` on CUDA: the Triton kernel for decoding; a prompt's chunk (more query
    rows than a program of the kernel holds) runs the PyTorch reference's ``"dense"`` strategy
    on the GPU: the layer's cache dequantized into one buffer (keys and values of one layer in
    the model's dtype), then one SDPA call."""
    if triton_fits(query, key):
        return mixed_attention_triton(query, key, value, new_valid, cache, scaling)
    return mixed_attention_reference(query, key, value, new_valid, cache, scaling)


USE_TRITON = HAVE_TRITON and os.environ.get("HQEKV_TRITON", "1") != "0"
"""CUDA tensors run the Triton kernels (triton installed, and not ``HQEKV_TRITON=0``)."""

REFERENCES = {
    quantize_pack: quantize_pack_reference,
    dequantize: dequantize_reference,
    mixed_attention: mixed_attention_reference,
}
"""Each op's pure-PyTorch implementation: what a device without its own kernel runs."""

KERNELS = {
    quantize_pack: {"cuda": quantize_pack_triton} if USE_TRITON else {},
    dequantize: {"cuda": dequantize_triton} if USE_TRITON else {},
    mixed_attention: {"cpu": mixed_attention_on_cpu, **({"cuda": mixed_attention_cuda} if USE_TRITON else {})},
}
"""The dispatch table: per op, the implementation each device type runs in place of the
reference. The ops are registered from it, and :func:`call` and :func:`attend` read it."""


def _flat(implementation):
    """An implementation taking a :class:`PackedCache`, as the op's flat schema calls it."""

    def run(query, key, value, new_valid, scaling, *cache):
        return implementation(query, key, value, new_valid, PackedCache(*cache), scaling)

    return run


for _op, _kernels in KERNELS.items():
    for _device, _kernel in _kernels.items():
        _op.register_kernel(_device)(_flat(_kernel) if _op is mixed_attention else _kernel)


def implementation(op, device: torch.device):
    """The function ``op`` runs for tensors on ``device`` (:data:`KERNELS`, else :data:`REFERENCES`)."""
    return KERNELS[op].get(device.type, REFERENCES[op])


def call(op, *args):
    """Run ``quantize_pack`` or ``dequantize``: as the op node while ``torch.compile`` traces, else
    straight to its implementation for the device (the op's dispatch costs ~0.1 ms a call
    in eager mode, a few ms per token over a model's layers)."""
    if torch.compiler.is_compiling():
        return op(*args)
    return implementation(op, args[0].device)(*args)


def attend(query: Tensor, key: Tensor, value: Tensor, new_valid: Tensor, cache: PackedCache, scaling: float) -> Tensor:
    """``mixed_attention`` over ``cache``, as :func:`call` runs the other ops."""
    if torch.compiler.is_compiling():
        return mixed_attention(query, key, value, new_valid, scaling, *cache)
    return implementation(mixed_attention, query.device)(query, key, value, new_valid, cache, scaling)

"""``dequantize``: packed codes + metadata -> chunks (N, H, G, D), the inverse of ``quantize_pack``.

The Triton helpers :func:`load_key_tile` / :func:`load_value_tile` read one chunk of one
head straight from its packed words into registers; ``mixed_attention`` uses them too.
"""

from __future__ import annotations

import torch

from ..packing import unpack_codes
from ..quantization import NORMALIZED, UNIFORM, dequantize, key_chunks, normal_tables, value_chunks
from ._triton import HAVE_TRITON, next_power_of_2, require_triton
from .quantize_pack import packed_shapes

if HAVE_TRITON:
    from ._triton import cast_rne, tl, triton


def check_args(codes, meta0, meta1, bits, normalized, per_channel, group, chunk_size, head_dim) -> None:
    torch._check(bits in (1, 2, 4, 8), lambda: f"bits must be 1, 2, 4 or 8, got {bits}")
    torch._check(1 <= group <= head_dim, lambda: f"value group {group} must be in [1, head dim {head_dim}]")
    torch._check(codes.dtype == torch.int32, lambda: f"codes must be int32 words, got {codes.dtype}")
    n, h = codes.shape[:2]
    want_codes, want_meta = packed_shapes((n, h, chunk_size, head_dim), bits, per_channel, group)
    torch._check(tuple(codes.shape) == want_codes, lambda: f"codes of shape {tuple(codes.shape)}, expected {want_codes}")
    for m in (meta0, meta1):
        torch._check(tuple(m.shape) == want_meta, lambda: f"metadata of shape {tuple(m.shape)}, expected {want_meta}")


def dequantize_reference(
    codes: torch.Tensor,
    meta0: torch.Tensor,
    meta1: torch.Tensor,
    bits: int,
    normalized: bool,
    per_channel: bool,
    group: int,
    chunk_size: int,
    head_dim: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Pure-PyTorch unpack + dequantize; the CPU implementation and the kernels' test reference.

    codes/meta as :func:`~hqekv.kernels.quantize_pack.quantize_pack_reference` returns them
    -> (N, H, chunk_size, head_dim) ``dtype``.
    """
    check_args(codes, meta0, meta1, bits, normalized, per_channel, group, chunk_size, head_dim)
    method = NORMALIZED if normalized else UNIFORM
    codes = unpack_codes(codes, bits, chunk_size if per_channel else group, torch.float32 if method == UNIFORM else torch.uint8)
    x = dequantize(codes, meta0, meta1, bits, method, dtype)
    if per_channel:
        return key_chunks(x)
    return value_chunks(x)[..., :head_dim]  # a short last group's padding codes dropped


def packed_value_tiles(group: int, head_dim: int) -> bool:
    """Whether value tiles can be read word-wise: groups of exactly 32 channels tiling BLOCK_D."""
    return group == 32 and next_power_of_2(head_dim) >= 32


if HAVE_TRITON:

    @triton.jit
    def dequantize_tile(codes, m0, m1, centres_ptr, BITS: tl.constexpr, NORMALIZED: tl.constexpr):
        """codes (int32), m0/m1 broadcastable to it -> fp32 values (scale/zero or std/mean)."""
        if NORMALIZED:
            return tl.load(centres_ptr + codes) * m0 + m1
        else:
            return codes.to(tl.float32) * m0 + m1

    @triton.jit
    def load_key_tile(
        pool, strides, centres_ptr, slot, head,
        G, D, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr, NORMALIZED: tl.constexpr,
    ):  # fmt: skip
        """One key chunk (G tokens, per-channel groups) -> (BLOCK_G, BLOCK_D) fp32.

        pool: the (codes, meta0, meta1) pointers of a packed key pool; strides: the codes'
        (slot, head, channel, word) and the metadata's (slot, head, channel), in elements.
        Each channel's words are read once, coalesced, and expanded in registers
        (BLOCK_G must be a multiple of 32 / BITS). Token rows past G hold finite filler.
        """
        codes_ptr, m0_ptr, m1_ptr = pool
        s_c, s_m = strides
        PER_WORD: tl.constexpr = 32 // BITS
        BLOCK_W: tl.constexpr = BLOCK_G // PER_WORD
        d = tl.arange(0, BLOCK_D)
        w = tl.arange(0, BLOCK_W)
        n_words = (G + PER_WORD - 1) // PER_WORD
        base = slot.to(tl.int64) * s_c[0] + head * s_c[1]
        words = tl.load(codes_ptr + base + d[:, None] * s_c[2] + w[None, :] * s_c[3],
                        mask=(d[:, None] < D) & (w[None, :] < n_words), other=0)  # fmt: skip
        shifts = tl.arange(0, PER_WORD) * BITS
        codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)  # expanded in registers
        codes = tl.trans(tl.reshape(codes, (BLOCK_D, BLOCK_G)))  # (BLOCK_G, BLOCK_D)
        mbase = slot.to(tl.int64) * s_m[0] + head * s_m[1]
        m0 = tl.load(m0_ptr + mbase + d * s_m[2], mask=d < D, other=0.0).to(tl.float32)
        m1 = tl.load(m1_ptr + mbase + d * s_m[2], mask=d < D, other=0.0).to(tl.float32)
        return dequantize_tile(codes, m0[None, :], m1[None, :], centres_ptr, BITS, NORMALIZED)

    @triton.jit
    def load_value_tile(
        pool, strides, centres_ptr, slot, head,
        G, D, GROUP, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr, NORMALIZED: tl.constexpr,
        PACKED: tl.constexpr,
    ):  # fmt: skip
        """One value chunk (per-token groups of GROUP channels) -> (BLOCK_G, BLOCK_D) fp32.

        pool: the (codes, meta0, meta1) pointers of a packed value pool; strides: the codes'
        (slot, head, token, group, word) and the metadata's (slot, head, token, group).
        PACKED (GROUP a power of two >= 32 with BLOCK_D = GROUP · 2^k): each token's words are
        read once and expanded in registers; otherwise each element reads its word.
        """
        codes_ptr, m0_ptr, m1_ptr = pool
        s_c, s_m = strides
        PER_WORD: tl.constexpr = 32 // BITS
        mbase = slot.to(tl.int64) * s_m[0] + head * s_m[1]
        base = slot.to(tl.int64) * s_c[0] + head * s_c[1]
        if PACKED:
            BLOCK_W: tl.constexpr = 32 // PER_WORD  # words of one group of 32 channels
            BLOCK_NG: tl.constexpr = BLOCK_D // 32
            j = tl.arange(0, BLOCK_G)[:, None, None]
            gi = tl.arange(0, BLOCK_NG)[None, :, None]
            w = tl.arange(0, BLOCK_W)[None, None, :]
            n_groups = (D + GROUP - 1) // GROUP
            words = tl.load(codes_ptr + base + j * s_c[2] + gi * s_c[3] + w * s_c[4],
                            mask=(j < G) & (gi < n_groups), other=0)  # fmt: skip
            shifts = tl.arange(0, PER_WORD) * BITS
            codes = (words[:, :, :, None] >> shifts[None, None, None, :]) & ((1 << BITS) - 1)
            codes = tl.reshape(codes, (BLOCK_G, BLOCK_D))  # channel = group · 32 + index
            jm = tl.arange(0, BLOCK_G)[:, None]
            gm = tl.arange(0, BLOCK_NG)[None, :]
            m_ok = (jm < G) & (gm < n_groups)
            m0 = tl.load(m0_ptr + mbase + jm * s_m[2] + gm * s_m[3], mask=m_ok, other=0.0).to(tl.float32)
            m1 = tl.load(m1_ptr + mbase + jm * s_m[2] + gm * s_m[3], mask=m_ok, other=0.0).to(tl.float32)
            m0 = tl.reshape(tl.broadcast_to(m0[:, :, None], (BLOCK_G, BLOCK_NG, 32)), (BLOCK_G, BLOCK_D))
            m1 = tl.reshape(tl.broadcast_to(m1[:, :, None], (BLOCK_G, BLOCK_NG, 32)), (BLOCK_G, BLOCK_D))
            return dequantize_tile(codes, m0, m1, centres_ptr, BITS, NORMALIZED)
        else:
            j = tl.arange(0, BLOCK_G)[:, None]
            d = tl.arange(0, BLOCK_D)[None, :]
            ok = (j < G) & (d < D)
            gi = d // GROUP
            idx = d % GROUP
            words = tl.load(codes_ptr + base + j * s_c[2] + gi * s_c[3] + (idx // PER_WORD) * s_c[4], mask=ok, other=0)
            codes = (words >> ((idx % PER_WORD) * BITS)) & ((1 << BITS) - 1)
            m0 = tl.load(m0_ptr + mbase + j * s_m[2] + gi * s_m[3], mask=ok, other=0.0).to(tl.float32)
            m1 = tl.load(m1_ptr + mbase + j * s_m[2] + gi * s_m[3], mask=ok, other=0.0).to(tl.float32)
            return dequantize_tile(codes, m0, m1, centres_ptr, BITS, NORMALIZED)


    @triton.jit
    def _dequantize_kernel(
        pool, strides, centres_ptr, out_ptr, out_strides,
        H, G, D, GROUP,
        PER_CHANNEL: tl.constexpr, BITS: tl.constexpr, NORMALIZED: tl.constexpr, OUT_BF16: tl.constexpr,
        PACKED_V: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """Program per (chunk, head): unpack + dequantize one (G, D) chunk.

        pool, strides: a packed pool as :func:`load_key_tile` (PER_CHANNEL) or
        :func:`load_value_tile` read it; out_strides: the output's, in elements.
        """
        pid = tl.program_id(0)
        slot = pid // H
        head = pid % H
        if PER_CHANNEL:
            x = load_key_tile(pool, strides, centres_ptr, slot, head, G, D, BLOCK_G, BLOCK_D, BITS, NORMALIZED)
        else:
            x = load_value_tile(pool, strides, centres_ptr, slot, head, G, D, GROUP, BLOCK_G, BLOCK_D, BITS,
                                NORMALIZED, PACKED_V)  # fmt: skip
        j = tl.arange(0, BLOCK_G)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        s_o = out_strides
        out = out_ptr + slot.to(tl.int64) * s_o[0] + head * s_o[1] + j * s_o[2] + d * s_o[3]
        tl.store(out, cast_rne(x, out_ptr.dtype.element_ty, OUT_BF16), mask=(j < G) & (d < D))


def dequantize_triton(
    codes: torch.Tensor,
    meta0: torch.Tensor,
    meta1: torch.Tensor,
    bits: int,
    normalized: bool,
    per_channel: bool,
    group: int,
    chunk_size: int,
    head_dim: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    require_triton()
    check_args(codes, meta0, meta1, bits, normalized, per_channel, group, chunk_size, head_dim)
    n, h = codes.shape[:2]
    out = torch.empty(n, h, chunk_size, head_dim, dtype=dtype, device=codes.device)
    if out.numel() == 0:
        return out
    _, centres = normal_tables(bits, codes.device)
    torch._check(meta0.stride() == meta1.stride(), lambda: "meta0 and meta1 must share a layout")
    _dequantize_kernel[(n * h,)](
        (codes, meta0, meta1), (codes.stride(), meta0.stride()), centres, out, out.stride(),
        h, chunk_size, head_dim, group,
        PER_CHANNEL=per_channel, BITS=bits, NORMALIZED=normalized, OUT_BF16=dtype == torch.bfloat16,
        PACKED_V=packed_value_tiles(group, head_dim),
        BLOCK_G=max(32, next_power_of_2(chunk_size)), BLOCK_D=max(16, next_power_of_2(head_dim)),
    )  # fmt: skip
    return out

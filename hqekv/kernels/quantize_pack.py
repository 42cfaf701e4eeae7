"""``quantize_pack``: a chunk of keys or values -> packed codes + metadata (SPEC §1.1).

Layouts (``g`` = value channel group, ``ng = ceil(D / g)``, ``W(n) = ceil(n·bits / 32)``):

- keys, per-channel groups over the G tokens of a chunk:
  x (N, H, G, D) -> codes (N, H, D, W(G)) int32, meta0/meta1 (N, H, D)
- values, per-token groups of g channels (the last group may be shorter when g does not
  divide D; its unused code slots are 0):
  x (N, H, G, D) -> codes (N, H, G, ng, W(g)) int32, meta0/meta1 (N, H, G, ng)

meta0/meta1 are scale/zero (uniform) or std/mean (normalized), in ``meta_dtype``.
"""

from __future__ import annotations

import torch

from ..packing import pack_codes, packed_words
from ..quantization import EPS, NORMALIZED, UNIFORM, key_groups, normal_tables, quantize, value_groups
from ._triton import EXACT_DIV, HAVE_TRITON, next_power_of_2, require_triton

if HAVE_TRITON:
    from ._triton import div_ieee, round_half_even, tl, cast_rne, triton


def packed_shapes(shape, bits: int, per_channel: bool, group: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(codes shape, metadata shape) of chunks of ``shape`` (N, H, G, D)."""
    n, h, g, d = shape
    if per_channel:
        return (n, h, d, packed_words(g, bits)), (n, h, d)
    ng = -(-d // group)
    return (n, h, g, ng, packed_words(group, bits)), (n, h, g, ng)


def check_args(x: torch.Tensor, bits: int, normalized: bool, group: int) -> None:
    torch._check(x.dim() == 4, lambda: f"chunks must be (N, H, G, D), got shape {tuple(x.shape)}")
    torch._check(x.dtype.is_floating_point, lambda: f"chunks must be floating point, got {x.dtype}")
    torch._check(bits in (1, 2, 4, 8), lambda: f"bits must be 1, 2, 4 or 8, got {bits}")
    torch._check(1 <= group <= x.shape[-1], lambda: f"value group {group} must be in [1, head dim {x.shape[-1]}]")
    if normalized:
        torch._check(bits <= 4, lambda: f"normalized quantization supports up to 4 bits, got {bits}")


def quantize_pack_reference(
    x: torch.Tensor, bits: int, normalized: bool, per_channel: bool, group: int, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-PyTorch quantize + pack; the CPU implementation and the kernels' test reference."""
    check_args(x, bits, normalized, group)
    method = NORMALIZED if normalized else UNIFORM
    if per_channel:
        codes, m0, m1 = quantize(key_groups(x), bits, method, meta_dtype)
        return pack_codes(codes, bits), m0, m1
    d = x.shape[-1]
    full = d // group * group
    parts = []
    if full:
        parts.append(quantize(value_groups(x[..., :full], group), bits, method, meta_dtype))
    if full < d:  # the last, shorter group; its codes are padded with zeros
        codes, m0, m1 = quantize(x[..., full:].unsqueeze(-2), bits, method, meta_dtype)
        parts.append((torch.nn.functional.pad(codes, (0, group - (d - full))), m0, m1))
    codes, m0, m1 = (torch.cat(t, dim=-2 if i == 0 else -1) for i, t in enumerate(zip(*parts)))
    return pack_codes(codes, bits), m0, m1


if HAVE_TRITON:

    @triton.jit
    def _quantize_pack_kernel(
        # pointers
        x_ptr, codes_ptr, m0_ptr, m1_ptr, bounds_ptr,
        # sizes: program p -> (i0, i1, i2), i2 fastest; R groups of E elements each, element
        # (r, e) valid while r*E + e < TOTAL (a short last value group)
        n1, n2, R, E, TOTAL,
        # strides, in elements
        sx0, sx1, sx2, sxr, sxe,
        sc0, sc1, sc2, scr, scw,
        sm0, sm1, sm2, smr,
        # compile-time
        BITS: tl.constexpr, NORMALIZED: tl.constexpr, EPS_: tl.constexpr, EXACT: tl.constexpr, META_BF16: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    ):  # fmt: skip
        """Quantize R groups of E elements and pack each group's codes into int32 words, LSB first."""
        # 1. program -> base offsets
        pid = tl.program_id(0)
        i2 = pid % n2
        i1 = (pid // n2) % n1
        i0 = pid // (n1 * n2)
        r = tl.arange(0, BLOCK_R)[:, None]
        e = tl.arange(0, BLOCK_E)[None, :]
        valid = (r < R) & (e < E) & (r * E + e < TOTAL)
        x_base = i0.to(tl.int64) * sx0 + i1 * sx1 + i2 * sx2
        x = tl.load(x_ptr + x_base + r * sxr + e * sxe, mask=valid, other=0.0).to(tl.float32)
        meta_ty = m0_ptr.dtype.element_ty

        # 2. metadata (as stored) and codes
        if NORMALIZED:
            # float64 statistics, rounded once: the same metadata as the reference
            x64 = x.to(tl.float64)
            count = tl.maximum(tl.sum(valid.to(tl.float64), 1), 1.0)
            mean64 = tl.sum(x64, 1) / count
            dev = tl.where(valid, x64 - mean64[:, None], 0.0)
            m0 = cast_rne(tl.sqrt(tl.sum(dev * dev, 1) / count), meta_ty, META_BF16)  # std
            m1 = cast_rne(mean64, meta_ty, META_BF16)  # mean
            denom = tl.maximum(m0.to(tl.float32), EPS_)
            z = div_ieee(x - m1.to(tl.float32)[:, None], tl.broadcast_to(denom[:, None], x.shape), EXACT)
            codes = tl.zeros((BLOCK_R, BLOCK_E), tl.int32)
            for i in tl.static_range(2**BITS - 1):
                codes += (z >= tl.load(bounds_ptr + i)).to(tl.int32)
        else:
            row_ok = tl.arange(0, BLOCK_R) < R
            lo = tl.where(row_ok, tl.min(tl.where(valid, x, float("inf")), 1), 0.0)
            hi = tl.where(row_ok, tl.max(tl.where(valid, x, -float("inf")), 1), 0.0)
            levels = tl.full(lo.shape, 2**BITS - 1, tl.float32)
            m0 = cast_rne(div_ieee(hi - lo, levels, EXACT), meta_ty, META_BF16)  # scale
            m1 = cast_rne(lo, meta_ty, META_BF16)  # zero
            denom = tl.maximum(m0.to(tl.float32), EPS_)
            q = round_half_even(div_ieee(x - m1.to(tl.float32)[:, None], tl.broadcast_to(denom[:, None], x.shape), EXACT))
            codes = tl.minimum(tl.maximum(q, 0.0), 2**BITS - 1).to(tl.int32)
        codes = tl.where(valid, codes, 0)

        # 3. pack PER_WORD codes per word, LSB first
        PER_WORD: tl.constexpr = 32 // BITS
        grouped = tl.reshape(codes.to(tl.int64), (BLOCK_R, BLOCK_E // PER_WORD, PER_WORD))
        shifts = (tl.arange(0, PER_WORD) * BITS).to(tl.int64)
        words = tl.sum(grouped << shifts[None, None, :], 2)
        words = tl.where(words >= 2147483648, words - 4294967296, words).to(tl.int32)

        # 4. store
        w = tl.arange(0, BLOCK_E // PER_WORD)[None, :]
        n_words = (E + PER_WORD - 1) // PER_WORD
        c_base = i0.to(tl.int64) * sc0 + i1 * sc1 + i2 * sc2
        tl.store(codes_ptr + c_base + r * scr + w * scw, words, mask=(r < R) & (w < n_words))
        rr = tl.arange(0, BLOCK_R)
        m_base = i0.to(tl.int64) * sm0 + i1 * sm1 + i2 * sm2
        tl.store(m0_ptr + m_base + rr * smr, m0, mask=rr < R)
        tl.store(m1_ptr + m_base + rr * smr, m1, mask=rr < R)


def quantize_pack_triton(
    x: torch.Tensor, bits: int, normalized: bool, per_channel: bool, group: int, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    require_triton()
    check_args(x, bits, normalized, group)
    codes_shape, meta_shape = packed_shapes(x.shape, bits, per_channel, group)
    codes = torch.empty(codes_shape, dtype=torch.int32, device=x.device)
    m0 = torch.empty(meta_shape, dtype=meta_dtype, device=x.device)
    m1 = torch.empty(meta_shape, dtype=meta_dtype, device=x.device)
    n, h, g, d = x.shape
    if x.numel() == 0:
        return codes, m0, m1
    bounds, _ = normal_tables(bits, x.device)
    per_word = 32 // bits
    sx = x.stride()
    if per_channel:  # program per (chunk, head): R = D channels of E = G tokens
        n1, n2, rows, elems, total = h, 1, d, g, d * g
        x_strides = (sx[0], sx[1], 0, sx[3], sx[2])
        c_strides = (codes.stride(0), codes.stride(1), 0, codes.stride(2), codes.stride(3))
        m_strides = (m0.stride(0), m0.stride(1), 0, m0.stride(2))
    else:  # program per (chunk, head, token): R = ng groups of E = group channels
        n1, n2, rows, elems, total = h, g, meta_shape[-1], group, d
        x_strides = (sx[0], sx[1], sx[2], sx[3] * group, sx[3])
        c_strides = codes.stride()
        m_strides = m0.stride()
    block_e = max(next_power_of_2(elems), per_word)
    _quantize_pack_kernel[(n * n1 * n2,)](
        x, codes, m0, m1, bounds,
        n1, n2, rows, elems, total,
        *x_strides, *c_strides, *m_strides,
        BITS=bits, NORMALIZED=normalized, EPS_=EPS, EXACT=EXACT_DIV, META_BF16=meta_dtype == torch.bfloat16,
        BLOCK_R=next_power_of_2(rows), BLOCK_E=block_e,
    )  # fmt: skip
    return codes, m0, m1

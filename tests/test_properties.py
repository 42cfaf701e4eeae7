"""Property tests (hypothesis) of quantize -> pack -> unpack -> dequantize, the path every
cached chunk takes (``hqekv::quantize_pack`` then ``hqekv::dequantize``, CPU reference)."""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hqekv.cache.pools import KEY, VALUE, decode_chunks, encode_chunks  # noqa: E402
from hqekv.packing import pack_codes, unpack_codes  # noqa: E402
from hqekv.tiers import INT1, INT2, INT4, TIERS  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Largest magnitude per dtype that the format holds: a group's range (up to twice the
# magnitude) must fit the float32 arithmetic of the kernels.
MAX_MAGNITUDE = {torch.float32: 1e38, torch.float16: 6e4, torch.bfloat16: 1e38}


@st.composite
def chunks(draw):
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    n, h = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    g = draw(st.sampled_from([8, 32]))
    d = draw(st.sampled_from([16, 32, 64]))
    group = draw(st.sampled_from([v for v in (16, 32, 64) if d % v == 0]))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 300.0, MAX_MAGNITUDE[dtype]]))
    kind = draw(st.sampled_from(["random", "constant", "near-constant"]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, g, d, generator=gen, dtype=torch.float64).clamp(-4, 4) / 4 * magnitude
    if kind == "constant":
        x = torch.full_like(x, float(x[0, 0, 0, 0]))
    elif kind == "near-constant":
        x = float(x[0, 0, 0, 0]) + x * 1e-4
    return x.to(dtype), group, dtype


@settings(max_examples=120, deadline=None)
@given(chunks(), st.sampled_from([INT4, INT2, INT1]), st.sampled_from([KEY, VALUE]))
def test_round_trip_is_finite_in_range_and_within_half_a_step(case, tier, component):
    x, group, dtype = case
    assert torch.isfinite(x).all()
    meta_dtype = dtype  # the metadata dtype a model of this dtype stores (wide enough for its range)
    pool = encode_chunks(x, tier, component, group, meta_dtype)
    n, h, g, d = x.shape
    out = decode_chunks(pool, tier, component, g, d, group, dtype)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "finite input gave NaN/inf"
    assert torch.isfinite(pool.meta0.float()).all() and torch.isfinite(pool.meta1.float()).all()
    if TIERS[tier].method == "uniform":
        # per group: |x - x̂| <= scale/2, plus the rounding of the stored zero and of the output dtype
        groups = x.float().transpose(-1, -2) if component == KEY else x.float().reshape(n, h, g, d // group, group)
        rec = out.float().transpose(-1, -2) if component == KEY else out.float().reshape(n, h, g, d // group, group)
        scale = pool.meta0.float()[..., None]
        ulp = torch.finfo(dtype).eps * groups.abs().amax(-1, keepdim=True)
        # a step below the metadata dtype's normal range is stored with its subnormal spacing
        info = torch.finfo(meta_dtype)
        floor = (2**TIERS[tier].code_bits - 1) * info.smallest_normal * info.eps
        assert bool(((groups - rec).abs() <= scale / 2 + 2 * ulp + floor).all())
    else:  # normalized 1-bit: each value decodes to mean ± c·std of its own group
        assert bool((out.float() - x.float()).abs().amax() <= 4 * x.float().abs().amax() + 1e-30)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.integers(1, 200), st.integers(1, 3), st.integers(0, 2**16))
def test_packing_is_lossless_and_codes_stay_in_range(bits, n, rows, seed):
    codes = torch.randint(0, 2**bits, (rows, n), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    words = pack_codes(codes, bits)
    assert words.dtype == torch.int32
    back = unpack_codes(words, bits, n)
    assert torch.equal(back, codes)
    assert int(back.max()) < 2**bits

import math

import pytest
import torch

from hqekv.quantization import (
    dequantize_normalized,
    dequantize_uniform,
    key_chunks,
    key_groups,
    normal_tables,
    quantize_normalized,
    quantize_uniform,
    value_chunks,
    value_groups,
)


def test_uniform_codes_by_hand():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [-1.0, -0.5, 0.0, 2.0]])
    codes, scale, zero = quantize_uniform(x, 2)
    # row 0: zero 0, scale 1 -> codes 0..3; row 1: zero -1, scale 1 -> (0, 0.5, 1, 3) rounded half-even
    assert codes.tolist() == [[0, 1, 2, 3], [0, 0, 1, 3]]
    assert scale.tolist() == [1.0, 1.0] and zero.tolist() == [0.0, -1.0]
    x4 = torch.tensor([[0.0, 7.5, 15.0, 3.2]])
    codes, scale, zero = quantize_uniform(x4, 4)
    assert codes.tolist() == [[0, 8, 15, 3]] and scale.item() == 1.0
    assert dequantize_uniform(codes, scale, zero, torch.float32).tolist() == [[0.0, 8.0, 15.0, 3.0]]


def test_normalized_one_bit_by_hand():
    boundaries, centres = normal_tables(1)
    assert boundaries.tolist() == [0.0]
    assert centres[1].item() == pytest.approx(0.6745, abs=1e-4) and centres[0].item() == -centres[1].item()
    x = torch.tensor([[1.0, -1.0, 3.0, -3.0]])  # mean 0, std sqrt(5)
    codes, std, mean = quantize_normalized(x, 1)
    assert codes.tolist() == [[1, 0, 1, 0]]
    assert std.item() == pytest.approx(math.sqrt(5)) and mean.item() == 0.0
    xhat = dequantize_normalized(codes, std, mean, 1, torch.float32)
    assert xhat[0, 0].item() == pytest.approx(0.6745 * math.sqrt(5), rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("value", [0.0, 1.5, -3.25])
def test_constant_groups_round_trip_exactly(dtype, value):
    x = torch.full((3, 32), value, dtype=dtype)
    for bits in (4, 2, 1):
        codes, scale, zero = quantize_uniform(x, bits)
        out = dequantize_uniform(codes, scale, zero, dtype)
        assert torch.equal(out, x), (bits, out)
    codes, std, mean = quantize_normalized(x, 1)
    out = dequantize_normalized(codes, std, mean, 1, dtype)
    assert torch.equal(out, x)


def test_error_shrinks_with_more_bits():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    errors = []
    for bits in (1, 2, 4, 8):
        c, s, z = quantize_uniform(x, bits)
        errors.append((dequantize_uniform(c, s, z, torch.float32) - x).pow(2).mean().item())
    assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] / 100
    # normalized 1-bit beats uniform 1-bit on Gaussian data (why the paper uses it)
    c, s, m = quantize_normalized(x, 1)
    assert (dequantize_normalized(c, s, m, 1, torch.float32) - x).pow(2).mean().item() < errors[0]


def test_uniform_reconstruction_within_half_step():
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    c, s, z = quantize_uniform(x, 4, torch.float32)
    err = (dequantize_uniform(c, s, z, torch.float32) - x).abs()
    assert (err <= s[:, None] / 2 + 1e-6).all()


def test_no_nan_for_tiny_range_in_fp16_metadata():
    x = torch.full((2, 32), 0.1) + torch.arange(32) * 1e-9
    for bits in (4, 2):
        c, s, z = quantize_uniform(x, bits, torch.float16)
        assert torch.isfinite(dequantize_uniform(c, s, z, torch.float32)).all()
    c, s, m = quantize_normalized(x, 1, torch.float16)
    assert torch.isfinite(dequantize_normalized(c, s, m, 1, torch.float32)).all()


def test_layouts():
    chunks = torch.randn(2, 3, 32, 64)
    kg = key_groups(chunks)
    assert kg.shape == (2, 3, 64, 32) and torch.equal(kg[1, 2, 5], chunks[1, 2, :, 5])
    assert torch.equal(key_chunks(kg), chunks)
    vg = value_groups(chunks, 32)
    assert vg.shape == (2, 3, 32, 2, 32) and torch.equal(vg[0, 1, 4, 1], chunks[0, 1, 4, 32:])
    assert torch.equal(value_chunks(vg), chunks)
    with pytest.raises(ValueError, match="multiple"):
        value_groups(torch.randn(1, 1, 32, 48), 32)


@pytest.mark.parametrize("component", ["k", "v"])
def test_chunk_pools_round_trip_per_tier(component):
    from hqekv.cache.pools import decode_chunks, encode_chunks
    from hqekv.tiers import INT1, INT2, INT4

    chunks = torch.randn(3, 2, 32, 64, generator=torch.Generator().manual_seed(2))
    errors = []
    for tier, words in ((INT4, 4), (INT2, 2), (INT1, 1)):
        pool = encode_chunks(chunks, tier, component, 32, torch.float16)
        assert pool.codes.dtype == torch.int32 and pool.codes.shape[-1] == words
        assert pool.meta0.dtype == torch.float16
        out = decode_chunks(pool, tier, component, 32, 64, 32, torch.float32)
        assert out.shape == chunks.shape
        errors.append((out - chunks).pow(2).mean().item())
    assert errors[0] < errors[1] < errors[2] < 1.0
    constant = torch.full((1, 2, 32, 64), 0.5, dtype=torch.float16)
    for tier in (INT4, INT2, INT1):
        pool = encode_chunks(constant, tier, component, 32, torch.float16)
        assert torch.equal(decode_chunks(pool, tier, component, 32, 64, 32, torch.float16), constant)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_tables_written_by_fill_kernels_equal_the_copied_ones(bits):
    """While a CUDA graph records, the normal tables are written by fill kernels (no host
    copy): the same float32 values to the bit."""
    from hqekv.quantization import filled

    for table in normal_tables(bits):
        got = filled(table.tolist(), table.device)
        assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), table.view(torch.int32))


def test_tables_are_copied_to_a_device_once_when_a_cache_starts():
    """Kernel launches read the tables a cache's first input put on its device: no host copy
    per launch (blocking, and refused while a CUDA graph records). 'meta' stands in for a GPU."""
    from hqekv.quantization import _ON_DEVICE, prepare_tables

    device = torch.device("meta")
    for key in [k for k in _ON_DEVICE if k[1] == device]:
        del _ON_DEVICE[key]
    prepare_tables(device)
    for bits in (1, 2, 4):
        first = normal_tables(bits, device)
        assert first[0].device == device and all(a is b for a, b in zip(first, normal_tables(bits, device)))

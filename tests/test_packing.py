import pytest
import torch

from hqekv.packing import pack_codes, packed_words, unpack_codes


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(32,), (3, 32), (2, 5, 7), (1, 33), (4, 1), (2, 3, 64)])
def test_round_trip_every_width_and_odd_shapes(bits, shape):
    g = torch.Generator().manual_seed(bits * 100 + len(shape))
    codes = torch.randint(0, 2**bits, shape, generator=g, dtype=torch.uint8)
    words = pack_codes(codes, bits)
    assert words.dtype == torch.int32
    assert words.shape == (*shape[:-1], packed_words(shape[-1], bits))
    assert torch.equal(unpack_codes(words, bits, shape[-1]), codes)


def test_lsb_first_layout_by_hand():
    # 2-bit codes 1, 2, 3, 0, ... -> word bits: c0 at bits 0-1, c1 at 2-3, ...
    codes = torch.tensor([1, 2, 3, 0] + [0] * 12, dtype=torch.uint8)
    assert pack_codes(codes, 2).tolist() == [1 | (2 << 2) | (3 << 4)]
    # Top bit set: the word is the int32 two's complement of 0x80000000.
    codes = torch.zeros(32, dtype=torch.uint8)
    codes[31] = 1
    assert pack_codes(codes, 1).tolist() == [-(2**31)]
    all_ones = torch.full((8,), 15, dtype=torch.uint8)
    assert pack_codes(all_ones, 4).tolist() == [-1]


def test_dense_size():
    assert packed_words(32, 4) == 4 and packed_words(32, 2) == 2 and packed_words(32, 1) == 1
    assert packed_words(33, 1) == 2


def test_bad_bits_and_word_count():
    with pytest.raises(ValueError, match="bits"):
        pack_codes(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="words"):
        unpack_codes(torch.zeros(3, dtype=torch.int32), 4, 8)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [32, 24, 64])
def test_unpack_to_float_equals_unpack_to_uint8(bits, n):
    codes = torch.randint(0, 2**bits, (3, 5, n), generator=torch.Generator().manual_seed(bits))
    words = pack_codes(codes, bits)
    as_float = unpack_codes(words, bits, n, torch.float32)
    assert as_float.dtype == torch.float32
    assert torch.equal(as_float, unpack_codes(words, bits, n).float())
    assert torch.equal(as_float, codes.float())


@pytest.mark.parametrize("bits", [1, 4])
def test_unpack_to_float_reads_words_with_any_strides(bits):
    codes = torch.randint(0, 2**bits, (2, 32 // bits), generator=torch.Generator().manual_seed(0))
    words = pack_codes(codes, bits)  # (2, 1)
    odd = torch.empty_strided((2, 1), (1, 0), dtype=torch.int32)  # a size-1 axis with stride 0
    odd.copy_(words)
    assert torch.equal(unpack_codes(odd, bits, 32 // bits, torch.float32), codes.float())
    assert torch.equal(unpack_codes(words.t().contiguous().t(), bits, 32 // bits, torch.float32), codes.float())
    wide = pack_codes(torch.randint(0, 2**bits, (3, 4, 64), generator=torch.Generator().manual_seed(1)), bits)
    view = wide.transpose(0, 1)  # (4, 3, W) non-contiguous
    assert torch.equal(unpack_codes(view, bits, 64, torch.float32), unpack_codes(view.contiguous(), bits, 64))


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_unpack_into_a_slice_of_a_buffer_writes_there_only(bits):
    codes = torch.randint(0, 2**bits, (3, 2, 32), generator=torch.Generator().manual_seed(bits))
    words = pack_codes(codes, bits).transpose(0, 1)  # (2, 3, W), non-contiguous
    buffer = torch.full((2, 5, 32), -1.0)
    target = buffer[:, 1:4]  # (2, 3, 32), not contiguous
    assert unpack_codes(words, bits, 32, torch.float32, out=target) is target
    assert torch.equal(buffer[:, 1:4], codes.transpose(0, 1).float())
    assert bool((buffer[:, 0] == -1).all() and (buffer[:, 4] == -1).all())
    with pytest.raises(ValueError, match="out must be"):
        unpack_codes(words, bits, 32, torch.float32, out=torch.empty(2, 3, 31))

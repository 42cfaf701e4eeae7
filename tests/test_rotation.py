"""The orthogonal rotation of the head dimension (hqekv.rotation) and the cache that uses it."""

from __future__ import annotations

import pytest
import torch

import hqekv
from hqekv.cache import rerank
from hqekv.cache.pools import VALUE, decode_chunks, encode_chunks
from hqekv.config import HqeKVConfig, TierRatios
from hqekv.patching import output_cache
from hqekv.tiers import INT1, INT2
from hqekv.rotation import hadamard_block, rotate, rotation_matrix, unrotate


@pytest.mark.parametrize("d,block", [(16, 16), (64, 64), (96, 32), (80, 16), (256, 256)])
def test_hadamard_is_orthogonal_symmetric_and_block_diagonal(d, block):
    r = rotation_matrix("hadamard", d)
    assert r.shape == (d, d) and r.dtype == torch.float32
    assert hadamard_block(d) == block
    torch.testing.assert_close(r @ r.T, torch.eye(d), atol=1e-6, rtol=0)
    assert torch.equal(r, r.T)
    # every entry of a block is ±1/√block, nothing outside the blocks
    inside = torch.block_diag(*[torch.ones(block, block)] * (d // block)).bool()
    assert torch.allclose(r[inside].abs(), torch.full((int(inside.sum()),), block**-0.5))
    assert torch.equal(r[~inside], torch.zeros(int((~inside).sum())))


def test_rotation_matrix_is_one_shared_constant_and_none_means_none():
    assert rotation_matrix("hadamard", 64) is rotation_matrix("hadamard", 64)
    assert rotation_matrix(None, 64) is None
    x = torch.randn(3, 64)
    assert rotate(x, None) is x and unrotate(x, None) is x
    with pytest.raises(ValueError, match="unknown rotation"):
        rotation_matrix("givens", 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_then_unrotate_is_the_identity_and_keeps_dot_products(dtype):
    r = rotation_matrix("hadamard", 64)
    q, k = torch.randn(5, 64).to(dtype), torch.randn(7, 64).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rotate(q, r).dtype == dtype
    torch.testing.assert_close(unrotate(rotate(q, r), r).float(), q.float(), atol=tol * 4, rtol=tol)
    torch.testing.assert_close((rotate(q, r).float() @ rotate(k, r).float().T), q.float() @ k.float().T, atol=tol * 40, rtol=tol)


def test_config_validates_rotation_and_the_paper_setting_stays_reachable():
    assert HqeKVConfig(ratios=TierRatios(int4=1.0), bavg=4).rotation is None  # the paper's setting by default
    assert HqeKVConfig(ratios=TierRatios(int4=1.0), bavg=4, rotation="hadamard").rotation == "hadamard"
    with pytest.raises(ValueError, match="rotation must be one of"):
        HqeKVConfig(ratios=TierRatios(int4=1.0), bavg=4, rotation="random")


@pytest.mark.parametrize("tier", [INT2, INT1])
def test_rotation_lowers_low_bit_error_of_vectors_with_outlier_channels(tier):
    """What the rotation is for: one large channel per head (as RoPE'd keys and some values
    have) sets the range of every group it is in; rotated, the error is spread and smaller."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, 32, 64, generator=gen)
    x[..., 5] *= 12.0
    x[..., 40] += 6.0
    r = rotation_matrix("hadamard", 64)

    def round_trip(chunks):  # values: per-token groups of 64 channels
        codes = encode_chunks(chunks, tier, VALUE, 64, torch.float16)
        return decode_chunks(codes, tier, VALUE, 32, 64, 64, torch.float32)

    err_plain = (round_trip(x) - x).square().mean()
    err_rot = (unrotate(round_trip(rotate(x, r)), r) - x).square().mean()
    assert err_rot < 0.8 * err_plain, (float(err_rot), float(err_plain))


def test_rotated_fp16_cache_reproduces_the_unpatched_model(tiny):
    """Rotation changes no score and no output beyond float32 rounding."""
    ids = torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = tiny(ids).logits
        hqekv.patch_model(tiny, ratios=TierRatios(fp16=1.0), fp_dtype="model", rotation="hadamard")
        try:
            out = tiny(ids[:, :100], use_cache=True)
            cache = output_cache(out)
            rest = [tiny(ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits for i in range(100, 150)]
            layer = cache.layers[0]
            assert layer.rotation is not None
        finally:
            hqekv.unpatch_model(tiny)
    got = torch.cat([out.logits, *rest], 1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_chunk_scores_do_not_depend_on_the_rotation(tiny):
    """The rotation changes what the quantizers see, not which chunks matter."""
    ids = torch.randint(1, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    scores = {}
    for rotation in (None, "hadamard"):
        hqekv.patch_model(tiny, ratios=TierRatios(fp16=1.0), fp_dtype="model", rotation=rotation)
        try:
            with torch.no_grad():
                cache = output_cache(tiny(ids, use_cache=True))
            scores[rotation] = [rerank.chunk_scores(layer) for layer in cache.layers]
        finally:
            hqekv.unpatch_model(tiny)
    for plain, rotated in zip(scores[None], scores["hadamard"]):
        for a, b in zip(plain, rotated):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)

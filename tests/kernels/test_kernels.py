"""The Triton kernels against their PyTorch references, opcheck, and compile of the ops.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set in ``tests/conftest.py``). Codes
and metadata must match the reference exactly; attention outputs within the tolerances in
:data:`ATTENTION_TOL` (relative to the output scale: fp32 rounding, then about two units in
the last place of fp16 / bf16, where the kernel multiplies in that dtype).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hqekv import kernels
from hqekv.kernels._triton import HAVE_TRITON
from hqekv.kernels.dequantize import dequantize_reference, dequantize_triton
from hqekv.kernels import mixed_attention_cpu as cpu_kernel
from hqekv.kernels.mixed_attention import (PackedCache, _tiled_attention, mixed_attention_reference,
                                           mixed_attention_triton)
from hqekv.tiers import FP16, INT4
from hqekv.kernels.quantize_pack import quantize_pack_reference, quantize_pack_triton

from .random_cache import op_arguments, packed, random_mixed_cache

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [(4, False), (2, False), (1, True)]  # the three quantized tiers
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CHUNK_SHAPES = [
    (3, 2, 32, 64),  # SmolLM2-like: G = 32, D = 64
    (2, 1, 24, 80),  # G = 24 (not a multiple of 32 codes per word), value group 32 does not divide D = 80
    (1, 3, 16, 48),  # short chunks, a short last value group of 16
]
ATTENTION_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def meta_dtype_for(dtype):
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


def to_device(args: dict) -> dict:
    """Keyword arguments of ``mixed_attention`` with every tensor on the test device."""
    return {k: ([t.to(DEVICE) for t in v] if isinstance(v, list) else v.to(DEVICE) if torch.is_tensor(v) else v)
            for k, v in args.items()}  # fmt: skip


def chunks_for(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.linspace(0.1, 8.0, shape[-1])  # channels of different scales
    x[0, 0] = 0.75  # a constant chunk: every group constant
    if shape[0] > 1:
        x[1, 0, :, :3] = 0.0  # constant channels inside a varied chunk
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("shape", CHUNK_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,normalized", FORMATS)
@pytest.mark.parametrize("per_channel", [True, False], ids=["keys", "values"])
def test_quantize_pack_kernel_equals_reference(shape, dtype, bits, normalized, per_channel):
    x = chunks_for(shape, dtype)
    args = (bits, normalized, per_channel, 32, meta_dtype_for(dtype))
    expected = quantize_pack_reference(x.cpu(), *args)
    got = quantize_pack_triton(x, *args)
    for name, e, g in zip(("codes", "meta0", "meta1"), expected, got):
        assert g.shape == e.shape and g.dtype == e.dtype, name
        torch.testing.assert_close(g.cpu(), e, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("shape", CHUNK_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,normalized", FORMATS)
@pytest.mark.parametrize("per_channel", [True, False], ids=["keys", "values"])
def test_dequantize_kernel_equals_reference(shape, dtype, bits, normalized, per_channel):
    x = chunks_for(shape, dtype, seed=1).cpu()
    packed = quantize_pack_reference(x, bits, normalized, per_channel, 32, meta_dtype_for(dtype))
    args = (bits, normalized, per_channel, 32, shape[2], shape[3], dtype)
    expected = dequantize_reference(*packed, *args)
    got = dequantize_triton(*(t.to(DEVICE) for t in packed), *args)
    # the interpreter computes code·scale + zero exactly as torch does; a GPU may fuse it into one FMA
    tol = 0 if DEVICE == "cpu" else torch.finfo(dtype).eps
    torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("per_channel", [True, False], ids=["keys", "values"])
def test_uniform_round_trip_error_is_within_half_a_step(per_channel):
    x = chunks_for((2, 2, 32, 80), torch.float32, seed=2).cpu()
    for bits in (4, 2):
        codes, scale, zero = quantize_pack_reference(x, bits, False, per_channel, 32, torch.float32)
        y = dequantize_reference(codes, scale, zero, bits, False, per_channel, 32, 32, 80, torch.float32)
        if per_channel:
            step = scale[:, :, None, :]  # (N, H, 1, D)
        else:
            step = scale.repeat_interleave(32, dim=-1)[..., :80]  # (N, H, G, D)
        assert ((y - x).abs() <= step / 2 + 1e-5).all()
    assert torch.equal(y[0, 0], x[0, 0])  # the constant chunk round-trips exactly


MIXED_SHAPES = {
    "decode": dict(b=2, hq=4, hkv=2, s=1, d=16, n_chunks=5, value_group=16),
    "gqa-7:1-odd": dict(b=1, hq=7, hkv=1, s=3, d=48, n_chunks=4, g=24, value_group=32, empty_every=3),
    "one-kv-head": dict(b=2, hq=1, hkv=1, s=2, d=32, n_chunks=3),
    "group-not-dividing": dict(b=1, hq=2, hkv=1, s=1, d=80, n_chunks=3, value_group=32),
    "no-chunks": dict(b=2, hq=2, hkv=2, s=2, d=64, n_chunks=0),
}


@pytest.mark.parametrize("name", list(MIXED_SHAPES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_attention_kernel_equals_reference(name, dtype):
    args = random_mixed_cache(dtype=dtype, **MIXED_SHAPES[name])
    expected = mixed_attention_reference(**packed(args), strategy="pools")
    torch.testing.assert_close(mixed_attention_reference(**packed(args), strategy="dense").float(), expected.float(),
                               atol=ATTENTION_TOL[dtype] * expected.abs().max().item(), rtol=0)  # fmt: skip
    on_device = to_device(args)
    tol = ATTENTION_TOL[dtype]
    scale = expected.abs().max().item()
    for splits in (1, 2):
        got = mixed_attention_triton(**packed(on_device), n_splits=splits).cpu()
        assert got.shape == expected.shape and got.dtype == expected.dtype
        torch.testing.assert_close(got.float(), expected.float(), atol=tol * scale, rtol=0)


@pytest.mark.parametrize("fp_dtype", [torch.float16, torch.bfloat16])
def test_mixed_attention_fp32_queries_over_16_bit_full_precision_parts(fp_dtype):
    """An fp32 model's cache keeps FP16 chunks and the tail in 16 bits: both paths read them so."""
    args = random_mixed_cache(dtype=torch.float32, fp_dtype=fp_dtype, **MIXED_SHAPES["decode"])
    assert args["k_pools"][0].dtype == fp_dtype and args["tail_k"].dtype == fp_dtype
    widened = dict(args, k_pools=[args["k_pools"][0].float(), *args["k_pools"][1:]],
                   v_pools=[args["v_pools"][0].float(), *args["v_pools"][1:]],
                   tail_k=args["tail_k"].float(), tail_v=args["tail_v"].float())  # fmt: skip
    expected = mixed_attention_reference(**packed(widened), strategy="dense")
    assert expected.dtype == torch.float32
    scale = expected.abs().max().item()
    for strategy in ("pools", "dense"):
        torch.testing.assert_close(mixed_attention_reference(**packed(args), strategy=strategy), expected, atol=2e-5 * scale, rtol=0)
    on_device = to_device(args)
    got = mixed_attention_triton(**packed(on_device)).cpu()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=ATTENTION_TOL[torch.float32] * scale, rtol=0)


@pytest.mark.parametrize("name", list(MIXED_SHAPES))
def test_mixed_attention_strategies_agree(name):
    """Reading pools per tier and attending over a dense dequantized copy give the same output."""
    args = random_mixed_cache(dtype=torch.float32, **MIXED_SHAPES[name])
    pools = mixed_attention_reference(**packed(args), strategy="pools")
    dense = mixed_attention_reference(**packed(args), strategy="dense")
    torch.testing.assert_close(pools, dense, atol=2e-5, rtol=1e-5)
    for tile in (1, 2, 64):  # tiles of the table merged by log-sum-exp: one block or several
        tiled = _tiled_attention(**packed(args), tile=tile)
        torch.testing.assert_close(tiled, dense, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tiled_attention_of_a_prompt_chunk_matches_the_dense_copy_in_16_bits(dtype):
    """A prompt chunk of many queries over a long table, with padding, in the model's dtype."""
    args = random_mixed_cache(dtype=dtype, b=2, hq=8, hkv=2, s=40, d=32, n_chunks=9, value_group=32, empty_every=4)
    args["new_valid"][1, :13] = False  # left padding of the second row
    dense = mixed_attention_reference(**packed(args), strategy="dense")
    tiled = mixed_attention_reference(**packed(args), strategy="tiles")
    scale = dense.abs().max().item()
    torch.testing.assert_close(tiled.float(), dense.float(), atol=ATTENTION_TOL[dtype] * scale, rtol=0)


def as_fp16_chunks(args: dict) -> dict:
    """``args`` with every 4-bit chunk moved to a new FP16 slot holding its values, decoded
    at the width its pool was made with (``random_mixed_cache``'s ``int4_bits``)."""
    out = dict(args)
    for comp, width in zip(("k", "v"), args["int4_bits"]):
        pools, tier, slot = args[f"{comp}_pools"], args[f"{comp}_tier"].clone(), args[f"{comp}_slot"].clone()
        fp = pools[0]
        _, h, g, d = fp.shape
        decoded = dequantize_reference(*pools[1:4], width, False, comp == "k", args["value_group"], g, d, fp.dtype)
        rows, cols = (tier == INT4).nonzero(as_tuple=True)
        slot[rows, cols] = fp.shape[0] + slot[rows, cols]
        tier[rows, cols] = FP16
        out[f"{comp}_pools"] = [torch.cat([fp, decoded]), *pools[1:]]
        out[f"{comp}_tier"], out[f"{comp}_slot"] = tier, slot
    return out


@pytest.mark.parametrize("int4_bits", [(8, 4), (4, 8), (8, 8)], ids=["wide-keys", "wide-values", "wide-both"])
@pytest.mark.parametrize("s", [1, 3, 40], ids=["decode", "piece", "prompt-chunk"])
def test_a_4_bit_pool_of_8_bit_codes_is_read_at_8_bits_by_every_implementation(int4_bits, s):
    """A prompt's waiting chunks sit in the 4-bit tier's pools at 8 bits (``tiers.WIDE_BITS``):
    every implementation reads them at their width, as if their decoded values were FP16
    chunks; the CPU kernel refuses such a cache (the reference runs)."""
    shape = dict(b=2, hq=4, hkv=2, s=s, d=64, n_chunks=7, value_group=32, empty_every=5)
    args = random_mixed_cache(int4_bits=int4_bits, **shape)
    args["int4_bits"] = int4_bits
    assert kernels.tier_formats(args["k_pools"])[INT4][0] == int4_bits[0]
    assert kernels.tier_formats(args["v_pools"])[INT4][0] == int4_bits[1]
    fields = {k: v for k, v in args.items() if k != "int4_bits"}
    expected = mixed_attention_reference(**packed(as_fp16_chunks(args)), strategy="dense")
    scale = expected.abs().max().item()
    for strategy in ("pools", "dense", "tiles"):
        got = mixed_attention_reference(**packed(fields), strategy=strategy)
        torch.testing.assert_close(got, expected, atol=2e-5 * scale, rtol=0)
    got = kernels.attend(**packed(fields))  # the op's dispatch: on CPU, the reference for this cache
    torch.testing.assert_close(got, expected, atol=2e-5 * scale, rtol=0)
    assert not cpu_kernel.supports(fields["query"], PackedCache(*(fields[n] for n in PackedCache._fields)))
    if s * 2 <= 64:  # the Triton kernel's rows
        got = mixed_attention_triton(**packed(to_device(fields))).cpu()
        torch.testing.assert_close(got, expected, atol=ATTENTION_TOL[torch.float32] * scale, rtol=0)


def test_mixed_attention_query_that_sees_nothing_gets_zeros():
    args = random_mixed_cache(b=1, hq=2, hkv=1, s=2, d=16, n_chunks=0, value_group=16)
    args["tail_len"] = torch.zeros(1, dtype=torch.long)  # empty cache; new token 0 is padding
    expected = mixed_attention_reference(**packed(args), strategy="pools")
    assert torch.equal(expected[0, 0], torch.zeros_like(expected[0, 0]))
    assert torch.isfinite(expected).all()
    assert torch.equal(mixed_attention_reference(**packed(args), strategy="dense")[0, 0], expected[0, 0])
    assert torch.equal(mixed_attention_reference(**packed(args), strategy="tiles")[0, 0], expected[0, 0])
    on_device = to_device(args)
    got = mixed_attention_triton(**packed(on_device)).cpu()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("strategy", ["pools", "dense", "tiles"])
def test_mixed_attention_matches_dense_attention_when_every_chunk_is_fp16(strategy):
    """All-FP16 tables: the op is plain causal attention over the concatenated tokens."""
    args = random_mixed_cache(b=2, hq=4, hkv=2, s=3, d=16, n_chunks=3, value_group=16, tiers=(0,))
    args["new_valid"][:] = True
    out = mixed_attention_reference(**packed(args), strategy=strategy)
    fp_k, fp_v = args["k_pools"][0], args["v_pools"][0]
    for row in range(2):
        n_tail = int(args["tail_len"][row])
        keys = [fp_k[i] for i in args["k_slot"][row].tolist()] + [args["tail_k"][row, :, :n_tail]]
        values = [fp_v[i] for i in args["v_slot"][row].tolist()] + [args["tail_v"][row, :, :n_tail]]
        k = torch.cat([*keys, args["key"][row]], dim=1)
        v = torch.cat([*values, args["value"][row]], dim=1)
        k, v = k.repeat_interleave(2, dim=0), v.repeat_interleave(2, dim=0)
        logits = args["query"][row] @ k.transpose(-1, -2) * args["scaling"]
        n_old = k.shape[1] - 3
        causal = torch.ones(3, 3, dtype=torch.bool).tril()
        mask = torch.cat([torch.ones(3, n_old, dtype=torch.bool), causal], dim=1)
        dense = torch.softmax(logits.masked_fill(~mask, -torch.inf), -1) @ v  # (Hq, S, D)
        torch.testing.assert_close(out[row].transpose(0, 1), dense, atol=1e-5, rtol=1e-5)


def op_args():
    x = chunks_for((3, 2, 32, 48), torch.float32).cpu()
    packed = quantize_pack_reference(x, 1, True, False, 32, torch.float16)
    mixed = random_mixed_cache(b=2, hq=4, hkv=2, s=2, d=16, n_chunks=3, value_group=16)
    return {
        "quantize_pack": (kernels.quantize_pack, (x, 4, False, True, 32, torch.float16)),
        "dequantize": (kernels.dequantize, (*packed, 1, True, False, 32, 32, 48, torch.float32)),
        "mixed_attention": (kernels.mixed_attention, op_arguments(mixed)),
    }


@pytest.mark.parametrize("name", ["quantize_pack", "dequantize", "mixed_attention"])
def test_opcheck(name):
    op, args = op_args()[name]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("name", ["quantize_pack", "dequantize", "mixed_attention"])
def test_ops_compile_fullgraph(name):
    op, args = op_args()[name]
    torch._dynamo.reset()
    compiled = torch.compile(op, fullgraph=True, backend="aot_eager")
    expected, got = op(*args), compiled(*args)
    for e, g in zip(expected if isinstance(expected, tuple) else (expected,), got if isinstance(got, tuple) else (got,)):
        assert torch.equal(e, g)


def test_ops_are_registered_in_the_hqekv_namespace():
    for name in ("quantize_pack", "dequantize", "mixed_attention"):
        assert hasattr(torch.ops.hqekv, name)


def test_bad_arguments_get_clear_errors():
    x = torch.randn(2, 1, 32, 64)
    with pytest.raises(RuntimeError, match="bits must be"):
        kernels.quantize_pack(x, 3, False, True, 32, torch.float16)
    with pytest.raises(RuntimeError, match="value group"):
        kernels.quantize_pack(x, 4, False, False, 128, torch.float16)
    codes, m0, m1 = kernels.quantize_pack(x, 4, False, True, 32, torch.float16)
    with pytest.raises(RuntimeError, match="codes of shape"):
        kernels.dequantize(codes, m0, m1, 2, False, True, 32, 32, 64, torch.float32)
    args = random_mixed_cache(b=1, hq=3, hkv=2, s=1, d=16, n_chunks=1, value_group=16)
    with pytest.raises(RuntimeError, match="not a multiple"):
        kernels.mixed_attention(*op_arguments(args))


def test_hqekv_triton_0_keeps_cuda_on_the_references():
    code = "import hqekv.kernels.ops as ops; print(ops.USE_TRITON)"
    env = {**os.environ, "HQEKV_TRITON": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_attend_and_call_run_the_same_implementation_as_the_op():
    mixed = random_mixed_cache(b=2, hq=4, hkv=2, s=1, d=16, n_chunks=3, value_group=16)
    assert torch.equal(kernels.attend(**packed(mixed)), kernels.mixed_attention(*op_arguments(mixed)))
    op, args = op_args()["quantize_pack"]
    assert all(torch.equal(a, b) for a, b in zip(kernels.call(op, *args), op(*args)))


@pytest.mark.parametrize("tiers", [(0,), (0, 1, 2, 3)], ids=["fp16", "mixed"])
def test_rotated_inputs_kernel_equals_reference_and_fp16_output_is_the_rotated_one(tiers):
    """``rotation="hadamard"`` lives outside the op: the cache hands it rotated queries, keys,
    values, pools and tail. Both implementations must agree on such inputs, and over FP16
    chunks the output must be the unrotated output, rotated."""
    from hqekv.rotation import rotate, rotation_matrix, unrotate

    args = random_mixed_cache(b=2, hq=4, hkv=2, s=3, d=64, n_chunks=5, value_group=64, tiers=tiers)
    r = rotation_matrix("hadamard", 64)
    rotated = dict(args, query=rotate(args["query"], r), key=rotate(args["key"], r), value=rotate(args["value"], r),
                   tail_k=rotate(args["tail_k"], r), tail_v=rotate(args["tail_v"], r),
                   k_pools=[rotate(args["k_pools"][0], r), *args["k_pools"][1:]],
                   v_pools=[rotate(args["v_pools"][0], r), *args["v_pools"][1:]])  # fmt: skip
    expected = mixed_attention_reference(**packed(rotated), strategy="pools")
    scale = expected.abs().max().item()
    got = mixed_attention_triton(**packed(to_device(rotated))).cpu()
    torch.testing.assert_close(got, expected, atol=ATTENTION_TOL[torch.float32] * scale, rtol=0)
    if tiers == (0,):
        plain = mixed_attention_reference(**packed(args), strategy="pools")
        torch.testing.assert_close(unrotate(expected, r), plain, atol=1e-5 * scale, rtol=0)


def test_a_prompt_chunk_runs_the_tiled_attention_and_the_kernel_refuses_it():
    """A chunk of a prompt is more query rows than a program of the Triton kernel holds (a
    2048-token chunk of Llama-3-8B: 8192 rows, which Triton could not compile): the CUDA
    dispatch gives it to the tiled attention, and the kernel itself says why it refuses."""
    from hqekv.kernels.mixed_attention import TRITON_MAX_ROWS, triton_fits
    from hqekv.kernels.ops import mixed_attention_cuda

    s = TRITON_MAX_ROWS // 2 + 1  # two query heads per KV head: just over the limit
    args = random_mixed_cache(dtype=torch.float32, b=1, hq=4, hkv=2, s=s, d=16, n_chunks=3, value_group=16)
    assert not triton_fits(args["query"], args["key"])
    expected = mixed_attention_reference(**packed(args))
    torch.testing.assert_close(mixed_attention_cuda(**packed(args)), expected, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="more rows than the Triton kernel holds"):
        mixed_attention_triton(**packed(args))
    decode = random_mixed_cache(dtype=torch.float32, b=1, hq=4, hkv=2, s=TRITON_MAX_ROWS // 2, d=16, n_chunks=3, value_group=16)
    assert triton_fits(decode["query"], decode["key"])


def test_the_kernel_reads_column_major_tables_as_a_cache_keeps_them():
    """A cache keeps its chunk tables column-major (their width in no stride, for compiled
    steps); the kernel reads them in place, with the same result as contiguous tables."""
    args = random_mixed_cache(dtype=torch.float32, device=DEVICE, **MIXED_SHAPES["decode"])
    expected = mixed_attention_reference(**packed(args))
    for name in ("k_tier", "k_slot", "v_tier", "v_slot"):
        t = args[name]
        args[name] = torch.empty_strided(t.shape, (1, t.shape[0]), dtype=t.dtype, device=t.device).copy_(t)
        assert not args[name].is_contiguous()
    got = mixed_attention_triton(**packed(args))
    torch.testing.assert_close(got, expected, atol=ATTENTION_TOL[torch.float32] * expected.abs().max().item(), rtol=0)


def test_the_ops_are_registered_from_the_one_dispatch_table():
    """Each device's implementation in ``KERNELS`` is the one the op runs there, and a
    device without one runs the reference."""
    from hqekv.kernels import ops

    cpu = torch.device("cpu")
    assert ops.implementation(kernels.mixed_attention, cpu) is ops.mixed_attention_on_cpu
    assert ops.implementation(kernels.quantize_pack, cpu) is quantize_pack_reference
    assert ops.implementation(kernels.mixed_attention, torch.device("meta")) is mixed_attention_reference
    for op, table in ops.KERNELS.items():
        for device in table:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op._qualname, device.upper()), (op._qualname, device)

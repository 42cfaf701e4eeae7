"""The fused C decode attention (hqekv.kernels.mixed_attention_cpu) against the PyTorch reference, its errors,
and how the op chooses it.

Tolerances are those of the Triton kernel (``ATTENTION_TOL``, relative to the output scale):
the C kernel dequantizes each element as the reference does, then sums in another order.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from hqekv import kernels
from hqekv.kernels import mixed_attention_cpu as cpu, ops
from hqekv.kernels.mixed_attention import mixed_attention_reference

from .random_cache import op_arguments, packed, random_mixed_cache

ATTENTION_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SHAPES = {
    "smollm2-decode": dict(b=1, hq=9, hkv=3, s=1, d=64, n_chunks=40, value_group=64),  # whole-tile paths
    "decode": dict(b=2, hq=4, hkv=2, s=1, d=16, n_chunks=5, value_group=16),
    "gqa-7:1-odd": dict(b=1, hq=7, hkv=1, s=3, d=48, n_chunks=4, g=24, value_group=32, empty_every=3),
    "one-kv-head": dict(b=2, hq=1, hkv=1, s=2, d=32, n_chunks=3),
    "group-not-dividing": dict(b=1, hq=2, hkv=1, s=1, d=80, n_chunks=3, value_group=32),
    "no-chunks": dict(b=2, hq=2, hkv=2, s=2, d=64, n_chunks=0),
}

needs_kernel = pytest.mark.skipif(not cpu.available()[0], reason=f"no fused CPU kernel: {cpu.available()[1]}")


def test_the_kernel_builds_where_a_c_compiler_is_found():
    """A machine with a compiler must get the kernel: a build error is a failure, not a skip."""
    if not cpu.ENABLED or not (os.environ.get("CC") or any(map(shutil.which, ("cc", "gcc", "clang")))):
        pytest.skip("no C compiler, or HQEKV_CPU_KERNEL=0")
    assert cpu.available() == (True, "")


@needs_kernel
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_cpu_attention_equals_reference(name, dtype):
    args = random_mixed_cache(dtype=dtype, **SHAPES[name])
    expected = mixed_attention_reference(**packed(args), strategy="dense")
    got = cpu.mixed_attention_cpu(**packed(args))
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=ATTENTION_TOL[dtype] * expected.abs().max().item(), rtol=0)


@needs_kernel
@pytest.mark.parametrize("fp_dtype", [torch.float16, torch.bfloat16])
def test_fused_cpu_attention_reads_16_bit_full_precision_parts_under_fp32_queries(fp_dtype):
    args = random_mixed_cache(dtype=torch.float32, fp_dtype=fp_dtype, **SHAPES["smollm2-decode"])
    expected = mixed_attention_reference(**packed(args), strategy="dense")
    got = cpu.mixed_attention_cpu(**packed(args))
    torch.testing.assert_close(got, expected, atol=2e-5 * expected.abs().max().item(), rtol=0)


@needs_kernel
def test_fused_cpu_attention_query_that_sees_nothing_gets_zeros_and_a_nan_key_propagates():
    args = random_mixed_cache(b=1, hq=2, hkv=1, s=2, d=16, n_chunks=0, value_group=16)
    args["tail_len"] = torch.zeros(1, dtype=torch.long)  # empty cache; new token 0 is padding
    out = cpu.mixed_attention_cpu(**packed(args))
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    torch.testing.assert_close(out, mixed_attention_reference(**packed(args), strategy="dense"), atol=1e-5, rtol=0)

    args = random_mixed_cache(**SHAPES["decode"])
    args["tail_k"][1, 0, 0, 3] = float("nan")
    args["tail_len"][1] = max(int(args["tail_len"][1]), 1)
    out = cpu.mixed_attention_cpu(**packed(args))
    assert out[1, :, :2].isnan().all()  # query heads of KV head 0 see the NaN key
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, :, 2:]).all()


@needs_kernel
def test_fused_cpu_attention_refuses_a_table_that_names_a_missing_slot():
    args = random_mixed_cache(**SHAPES["decode"])
    args["k_slot"][0, 0] = args["k_pools"][0].shape[0] + 100
    args["k_tier"][0, 0] = 0
    with pytest.raises(ValueError, match="tier or slot"):
        cpu.mixed_attention_cpu(**packed(args))
    args = random_mixed_cache(**SHAPES["decode"])
    args["tail_len"][0] = 33
    with pytest.raises(ValueError, match="tail length"):
        cpu.mixed_attention_cpu(**packed(args))


@needs_kernel
def test_a_cpu_decode_step_runs_the_fused_kernel_and_a_longer_input_the_reference(monkeypatch):
    calls = []
    fused = cpu.mixed_attention_cpu
    monkeypatch.setattr(cpu, "mixed_attention_cpu", lambda *a: calls.append(a[0].shape[2]) or fused(*a))
    for name in ("smollm2-decode", "one-kv-head"):
        args = random_mixed_cache(**SHAPES[name])
        out = kernels.attend(**packed(args))
        torch.testing.assert_close(out, mixed_attention_reference(**packed(args)), atol=2e-5 * out.abs().max().item(), rtol=0)
        assert torch.equal(torch.ops.hqekv.mixed_attention(*op_arguments(args)), out)  # the op node runs the same
    assert calls == [1, 1]  # s = 2 went to the reference


def test_without_a_compiler_the_op_warns_once_and_answers_with_the_reference(tmp_path):
    script = """
import warnings, torch
from hqekv.kernels import mixed_attention_cpu as cpu, ops
from tests.kernels.random_cache import packed, random_mixed_cache
from hqekv.kernels.mixed_attention import mixed_attention_reference
args = random_mixed_cache(b=1, hq=2, hkv=1, s=1, d=16, n_chunks=3, value_group=16)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = ops.mixed_attention_on_cpu(**packed(args))
    ops.mixed_attention_on_cpu(**packed(args))
assert not cpu.available()[0] and "could not be built" in cpu.available()[1], cpu.available()
assert len(caught) == 1 and "reference" in str(caught[0].message), [str(w.message) for w in caught]
assert torch.equal(first, mixed_attention_reference(**packed(args)))
"""
    env = dict(os.environ, CC=str(tmp_path / "no-such-compiler"), HQEKV_CACHE=str(tmp_path / "cache"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@needs_kernel
def test_a_kernel_library_cut_short_in_the_cache_is_built_again_not_loaded(tmp_path):
    """A library truncated in ``$HQEKV_CACHE`` (a full disk, an interrupted copy) used to be
    loaded and kill every process that touched it with a bus error; it is rebuilt instead."""
    script = """
import torch
from hqekv.kernels import mixed_attention_cpu as cpu, ops
from tests.kernels.random_cache import packed, random_mixed_cache
from hqekv.kernels.mixed_attention import mixed_attention_reference
assert cpu.available()[0], cpu.available()
args = random_mixed_cache(b=1, hq=2, hkv=1, s=1, d=16, n_chunks=3, value_group=16)
out = ops.mixed_attention_on_cpu(**packed(args))
torch.testing.assert_close(out, mixed_attention_reference(**packed(args)), atol=1e-5, rtol=0)
"""
    env = dict(os.environ, HQEKV_CACHE=str(tmp_path / "cache"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def run():
        return subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True)

    done = run()
    assert done.returncode == 0, done.stderr[-3000:]
    (library,) = (tmp_path / "cache").glob("mixed_attention_cpu-*.so")
    whole = library.read_bytes()
    library.write_bytes(whole[: len(whole) // 3])
    done = run()
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert library.read_bytes() == whole  # built again, byte for byte


def test_hqekv_cpu_kernel_0_turns_the_kernel_off():
    done = subprocess.run(
        [sys.executable, "-c", "from hqekv.kernels import mixed_attention_cpu as cpu; print(cpu.available())"],
        env=dict(os.environ, HQEKV_CPU_KERNEL="0"), capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "turned off by HQEKV_CPU_KERNEL=0" in done.stdout


@needs_kernel
def test_fused_cpu_attention_shared_among_threads_equals_one_thread(monkeypatch):
    args = random_mixed_cache(**SHAPES["decode"])  # 2 rows × 2 KV heads
    one = cpu.mixed_attention_cpu(**packed(args))
    monkeypatch.setattr(cpu, "WORK_PER_THREAD", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # 4 pairs over 3 threads: uneven shares
    try:
        shared = cpu.mixed_attention_cpu(**packed(args))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(shared, one)


@needs_kernel
def test_fused_cpu_attention_refuses_pools_of_the_wrong_shape_before_reading_them():
    args = random_mixed_cache(**SHAPES["smollm2-decode"])
    args["v_pools"][1] = args["v_pools"][1][..., :-1]  # 4-bit value codes one word short
    with pytest.raises(ValueError, match="tier 1 codes"):
        cpu.mixed_attention_cpu(**packed(args))
    args = random_mixed_cache(**SHAPES["smollm2-decode"])
    with pytest.raises(ValueError, match="value group 0"):
        cpu.mixed_attention_cpu(**packed(dict(args, value_group=0)))
    args["k_pools"][0] = args["k_pools"][0][:, :, :16]  # FP16 key chunks of 16 tokens under a tail of 32
    with pytest.raises(ValueError, match="FP16 pool"):
        cpu.mixed_attention_cpu(**packed(args))


@needs_kernel
def test_inputs_the_kernel_does_not_take_go_to_the_reference():
    args = random_mixed_cache(**SHAPES["decode"])
    args["v_pools"][0] = args["v_pools"][0].to(torch.bfloat16)  # value FP16 pool in another dtype than the tail
    assert not cpu.supports(args["query"], packed(args)["cache"])
    out = ops.mixed_attention_on_cpu(**packed(args))
    assert torch.equal(out, mixed_attention_reference(**packed(args)))
    with pytest.raises(ValueError, match="C kernel takes"):
        cpu.mixed_attention_cpu(**packed(args))

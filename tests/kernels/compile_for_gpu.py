"""Compile every Triton kernel variant ahead of time for a GPU target, without a GPU.

The interpreter checks what the kernels compute; this checks that they also lower through
Triton's GPU pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the bundled ptxas), the
step a CPU-only machine cannot otherwise reach. Run without ``TRITON_INTERPRET``:

    python tests/kernels/compile_for_gpu.py [--arch 90]
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces the kernels it would compile")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

quantize_pack = importlib.import_module("hqekv.kernels.quantize_pack")
dequantize = importlib.import_module("hqekv.kernels.dequantize")
mixed_attention = importlib.import_module("hqekv.kernels.mixed_attention")

FLOATS = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}


def compile_kernel(kernel, pointers: dict[str, str], constexprs: dict, target: GPUTarget, floats=("scaling",)):
    """Lower ``kernel`` with the given pointer types and constexprs; other arguments are i32 (fp32 in ``floats``)."""
    names = kernel.arg_names
    constant = {p.name for p in kernel.params if p.is_constexpr}
    missing = constant - set(constexprs)
    if missing:
        raise ValueError(f"{kernel.__name__}: no value for constexprs {sorted(missing)}")
    signature = {}
    for name in names:
        if name in constant:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(source, target=target)


def variants(target: GPUTarget):
    """(description, thunk) for every kernel variant the launchers can ask for."""
    formats = [(4, False), (2, False), (1, True)]
    for (bits, normalized), dtype, meta in itertools.product(formats, ("fp32", "fp16", "bf16"), ("fp16", "bf16")):
        pointers = {"x_ptr": FLOATS[dtype], "codes_ptr": "*i32", "m0_ptr": FLOATS[meta], "m1_ptr": FLOATS[meta],
                    "bounds_ptr": "*fp32"}  # fmt: skip
        constexprs = dict(BITS=bits, NORMALIZED=normalized, EPS_=1e-6, EXACT=True, META_BF16=meta == "bf16",
                          BLOCK_R=64, BLOCK_E=32)  # fmt: skip
        yield f"quantize_pack {bits}-bit {dtype}/{meta}", lambda p=pointers, c=constexprs: compile_kernel(
            quantize_pack._quantize_pack_kernel, p, c, target
        )
    for (bits, normalized), per_channel, packed in itertools.product(formats, (True, False), (True, False)):
        if per_channel and not packed:
            continue
        pointers = {"codes_ptr": "*i32", "m0_ptr": "*fp16", "m1_ptr": "*fp16", "centres_ptr": "*fp32", "out_ptr": "*fp16"}
        constexprs = dict(PER_CHANNEL=per_channel, BITS=bits, NORMALIZED=normalized, OUT_BF16=False,
                          PACKED_V=packed, BLOCK_G=32, BLOCK_D=128 if packed else 16)  # fmt: skip
        yield f"dequantize {bits}-bit {'keys' if per_channel else 'values'}{' packed' if packed else ''}", (
            lambda p=pointers, c=constexprs: compile_kernel(dequantize._dequantize_kernel, p, c, target)
        )
    for dtype, packed in itertools.product(("fp16", "bf16", "fp32"), (True, False)):
        model, meta = FLOATS[dtype], FLOATS["bf16" if dtype == "bf16" else "fp16"]
        pointers = {n: model for n in ("q_ptr", "k_ptr", "v_ptr", "kf_ptr", "vf_ptr", "tk_ptr", "tv_ptr")}
        for comp in ("k", "v"):
            for bits in (4, 2, 1):
                pointers[f"{comp}{bits}c"] = "*i32"
                pointers[f"{comp}{bits}a"] = pointers[f"{comp}{bits}b"] = meta
        pointers.update({"valid_ptr": "*i8", "centres_ptr": "*fp32", "kt_ptr": "*i64", "ks_ptr": "*i64", "vt_ptr": "*i64",
                         "vs_ptr": "*i64", "tl_ptr": "*i64", "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32"})  # fmt: skip
        dot = {"fp16": triton.language.float16, "bf16": triton.language.bfloat16, "fp32": triton.language.float32}[dtype]
        constexprs = dict(BLOCK_R=16, BLOCK_G=32, BLOCK_S=16, BLOCK_D=128 if packed else 16, DOT_DTYPE=dot,
                          IEEE=dtype == "fp32", PACKED_V=packed)  # fmt: skip
        yield f"mixed_attention {dtype}{' packed values' if packed else ''}", (
            lambda p=pointers, c=constexprs: compile_kernel(mixed_attention._mixed_attention_kernel, p, c, target)
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    args = parser.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for name, build in variants(target):
        start = time.perf_counter()
        try:
            compiled = build()
            assert "cubin" in compiled.asm, "no cubin produced"
            print(f"ok    {name} ({time.perf_counter() - start:.1f} s)", flush=True)
        except Exception as error:  # report every variant, then fail
            failed += 1
            print(f"FAIL  {name}: {type(error).__name__}: {error}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

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


def compile_kernel(kernel, types: dict, constexprs: dict, target: GPUTarget, floats=("scaling",)):
    """Lower ``kernel`` with the given argument types (a pointer type such as ``*fp16``, or a
    tuple of types for a tuple argument) and constexprs; other arguments are i32 (fp32 in ``floats``)."""
    names = kernel.arg_names
    constant = {p.name for p in kernel.params if p.is_constexpr}
    missing = constant - set(constexprs)
    if missing:
        raise ValueError(f"{kernel.__name__}: no value for constexprs {sorted(missing)}")
    signature = {}
    for name in names:
        if name in constant:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(source, target=target)


def strides(n: int) -> tuple:
    return ("i32",) * n


def variants(target: GPUTarget):
    """(description, thunk) for every kernel variant the launchers can ask for."""
    formats = [(8, False), (4, False), (2, False), (1, True)]  # 8: a prompt's waiting keys (tiers.WIDE_BITS)
    for (bits, normalized), dtype, meta in itertools.product(formats, ("fp32", "fp16", "bf16"), ("fp16", "bf16")):
        types = {"x_ptr": FLOATS[dtype], "codes_ptr": "*i32", "m0_ptr": FLOATS[meta], "m1_ptr": FLOATS[meta],
                    "bounds_ptr": "*fp32"}  # fmt: skip
        constexprs = dict(BITS=bits, NORMALIZED=normalized, EPS_=1e-6, EXACT=True, META_BF16=meta == "bf16",
                          BLOCK_R=64, BLOCK_E=32)  # fmt: skip
        yield f"quantize_pack {bits}-bit {dtype}/{meta}", lambda t=types, c=constexprs: compile_kernel(
            quantize_pack._quantize_pack_kernel, t, c, target
        )
    for (bits, normalized), per_channel, packed in itertools.product(formats, (True, False), (True, False)):
        if per_channel and not packed:
            continue
        pool_strides = (strides(4), strides(3)) if per_channel else (strides(5), strides(4))
        types = {"pool": ("*i32", "*fp16", "*fp16"), "strides": pool_strides, "centres_ptr": "*fp32",
                 "out_ptr": "*fp16", "out_strides": strides(4)}  # fmt: skip
        constexprs = dict(PER_CHANNEL=per_channel, BITS=bits, NORMALIZED=normalized, OUT_BF16=False,
                          PACKED_V=packed, BLOCK_G=32, BLOCK_D=128 if packed else 16)  # fmt: skip
        yield f"dequantize {bits}-bit {'keys' if per_channel else 'values'}{' packed' if packed else ''}", (
            lambda t=types, c=constexprs: compile_kernel(dequantize._dequantize_kernel, t, c, target)
        )
    for dtype, packed, (k4, v4) in itertools.product(("fp16", "bf16", "fp32"), (True, False), ((4, 4), (8, 4))):
        model, meta = FLOATS[dtype], FLOATS["bf16" if dtype == "bf16" else "fp16"]
        packed_pool = ("*i32", meta, meta)
        types = {
            "new": (model,) * 3, "new_strides": (strides(3),) * 2, "valid_ptr": "*i8",
            "k_pools": (model, *(packed_pool,) * 3), "k_strides": (strides(3), *((strides(4), strides(3)),) * 3),
            "v_pools": (model, *(packed_pool,) * 3), "v_strides": (strides(3), *((strides(5), strides(4)),) * 3),
            "centres_ptr": "*fp32", "table": ("*i64",) * 4, "table_strides": strides(2),
            "tail": (model, model, "*i64"), "tail_strides": (strides(3), "i32"), "parts": ("*fp32",) * 3,
        }  # fmt: skip
        dot = {"fp16": triton.language.float16, "bf16": triton.language.bfloat16, "fp32": triton.language.float32}[dtype]
        constexprs = dict(BLOCK_R=16, BLOCK_G=32, BLOCK_S=16, BLOCK_D=128 if packed else 16, DOT_DTYPE=dot,
                          IEEE=dtype == "fp32", PACKED_V=packed, K4_BITS=k4, V4_BITS=v4)  # fmt: skip
        yield f"mixed_attention {dtype}{' packed values' if packed else ''}, 4-bit tier {k4}/{v4} bits", (
            lambda t=types, c=constexprs: compile_kernel(mixed_attention._mixed_attention_kernel, t, c, target)
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

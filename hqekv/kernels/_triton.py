"""Triton availability and the small device helpers shared by the kernels.

Triton is optional: without it (macOS, Windows) every op runs its PyTorch reference, on
any device, and only the Triton kernels are unavailable. ``TRITON_INTERPRET=1`` (set
before this module is imported) runs the same kernels on CPU tensors, which is how the
tests compare them with the references.
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = tl = None
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Kernels run under the Triton interpreter (numpy on CPU tensors)."""

EXACT_DIV = not INTERPRET
"""Use correctly rounded fp32 division on GPU (Triton's ``/`` is approximate there); the
interpreter's numpy division is already IEEE, and ``div_rn`` does not run under it."""


def require_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("the hqekv Triton kernels need the `triton` package (pip install triton)")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


if HAVE_TRITON:

    @triton.jit
    def div_ieee(a, b, EXACT: tl.constexpr):
        """a / b rounded to nearest, as torch computes it."""
        if EXACT:
            return tl.math.div_rn(a, b)
        else:
            return a / b

    @triton.jit
    def round_half_even(x):
        """torch.round: to nearest, ties to even (x - floor(x) is exact in fp32)."""
        r = tl.floor(x)
        f = x - r
        odd = r - 2.0 * tl.floor(r * 0.5)
        return tl.where(f > 0.5, r + 1.0, tl.where(f == 0.5, r + odd, r))

    @triton.jit
    def cast_rne(x, meta_ty: tl.constexpr, BF16: tl.constexpr):
        """Round fp32/fp64 ``x`` to ``meta_ty`` as torch does (bf16: via fp32, to nearest even).

        The bf16 rounding is done on the bits, so the interpreter (which truncates) and the GPU agree.
        """
        if BF16:
            bits = x.to(tl.float32).to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
        else:
            return x.to(meta_ty)

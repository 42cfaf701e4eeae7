"""Dense bit-packing of integer codes into int32 words (SPEC §1.1).

Codes are packed LSB first: word ``w`` holds codes ``w*k .. w*k+k-1`` with ``k = 32 // bits``,
code ``i`` of a word in bits ``[i*bits, (i+1)*bits)``.
"""

from __future__ import annotations

import functools
import sys

import torch

SUPPORTED_BITS = (1, 2, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def packed_words(n: int, bits: int) -> int:
    """Number of int32 words holding ``n`` codes of ``bits`` bits."""
    _check_bits(bits)
    per_word = 32 // bits
    return (n + per_word - 1) // per_word


@functools.lru_cache(maxsize=None)
def _byte_table(bits: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(256, 8 // bits) ``dtype``: the codes held by each byte value, LSB first (built once per device)."""
    per_byte = 8 // bits
    table = (torch.arange(256)[:, None] >> (torch.arange(per_byte) * bits)) & ((1 << bits) - 1)
    return table.to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(32 // bits, dtype=torch.int32, device=device) * bits


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes along the last axis.

    codes (..., n) integer in [0, 2**bits) -> words (..., ceil(n*bits/32)) int32.
    """
    _check_bits(bits)
    per_word = 32 // bits
    n = codes.shape[-1]
    n_words = packed_words(n, bits)
    pad = n_words * per_word - n
    c = codes.to(torch.int64)
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.reshape(*codes.shape[:-1], n_words, per_word)
    shifts = torch.arange(per_word, device=codes.device, dtype=torch.int64) * bits
    words = (c << shifts).sum(dim=-1)  # < 2**32, fits int64
    # Reinterpret the unsigned 32-bit pattern as two's-complement int32.
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_codes(
    words: torch.Tensor, bits: int, n: int, dtype: torch.dtype = torch.uint8, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`pack_codes`.

    words (..., ceil(n*bits/32)) int32 -> codes (..., n) ``dtype`` (uint8; float32 saves a pass
    when the codes are about to be scaled). ``out``: a (..., n) ``dtype`` tensor, any strides
    but a unit last one (e.g. a slice of a larger buffer), to write the codes into and return.
    """
    _check_bits(bits)
    per_word = 32 // bits
    whole = n == words.shape[-1] * per_word and sys.byteorder == "little"  # words are little-endian bytes
    if out is not None and (tuple(out.shape) != (*words.shape[:-1], n) or out.dtype != dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be a {dtype} tensor of shape {(*words.shape[:-1], n)} with a unit last stride")
    if words.shape[-1] != packed_words(n, bits):
        raise ValueError(
            f"{words.shape[-1]} words cannot hold exactly {n} codes of {bits} bits "
            f"(expected {packed_words(n, bits)} words)"
        )
    if out is None:
        out = torch.empty(*words.shape[:-1], n, dtype=dtype, device=words.device)
    if dtype.is_floating_point and bits == 4 and whole:
        # Each byte's two nibbles, masked and shifted as uint8 and converted straight into the
        # output (4x faster on CPU than a table lookup per byte, which writes 2 floats a byte).
        by = _as_bytes(words)  # byte k holds codes 2k and 2k + 1
        pairs = out.unflatten(-1, (n // 2, 2))
        pairs[..., 0].copy_(by & 15)
        pairs[..., 1].copy_(by >> 4)
    elif dtype.is_floating_point and bits == 1 and whole:
        # One table lookup per byte gives its 8 codes as floats directly (measured faster than
        # shift, mask and convert for 1 bit on CPU).
        table = _byte_table(bits, words.device, dtype)
        out.unflatten(-1, (n // 8, 8)).copy_(torch.nn.functional.embedding(_as_bytes(words).int(), table))
    else:
        # Arithmetic shifts of int32 words sign-extend; the mask keeps the code bits only.
        codes = (words.unsqueeze(-1) >> _shifts(bits, words.device)) & ((1 << bits) - 1)
        if whole:
            out.unflatten(-1, (words.shape[-1], per_word)).copy_(codes)
        else:
            out.copy_(codes.flatten(-2)[..., :n])
    return out


def _as_bytes(words: torch.Tensor) -> torch.Tensor:
    """(..., W) int32 -> (..., 4·W) uint8: each word's bytes, least significant first on a
    little-endian machine; a view of ``words`` when its last axis is contiguous (a size-1
    last axis may have any stride)."""
    if words.stride(-1) != 1:
        words = words.contiguous() if words.shape[-1] != 1 else words.as_strided(words.shape, (*words.stride()[:-1], 1))
    return words.view(torch.uint8)

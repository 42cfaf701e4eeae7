"""Group quantizers of HqeKV (SPEC §1.1), pure PyTorch.

Every function quantizes groups laid along the **last** axis: ``x (..., n)`` holds
``prod(...)`` groups of ``n`` elements, each with its own metadata pair. The layout
helpers at the bottom turn a chunk of keys or values into that shape:

- keys: per-channel groups over the G tokens of a chunk,
- values: per-token groups of ``group`` channels.

Codes are computed from the metadata *as stored* (rounded to the metadata dtype), so
dequantization reproduces exactly what the encoder assumed.
"""

from __future__ import annotations

import functools

import torch

EPS = float(torch.finfo(torch.float32).tiny)
"""Guard on scale / std (fix: a constant group must round-trip, never NaN). The smallest
normal float32, so that it only guards the division: a larger guard (it was 1e-6) coded
every value of a small-magnitude, near-constant group as its minimum."""

UNIFORM = "uniform"
NORMALIZED = "normalized"


def quantize_uniform(
    x: torch.Tensor, bits: int, meta_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniform asymmetric quantization of each group on the last axis.

    x (..., n) float -> codes (..., n) uint8 in [0, 2**bits), scale (...,), zero (...,) meta_dtype.
    ``zero = min``, ``scale = (max - min) / (2**bits - 1)``, ``code = round((x - zero) / scale)``.
    """
    meta_dtype = meta_dtype or x.dtype
    xf = x.float()
    lo = xf.amin(dim=-1)
    hi = xf.amax(dim=-1)
    levels = 2**bits - 1
    zero = lo.to(meta_dtype)
    scale = ((hi - lo) / levels).to(meta_dtype)
    # fix: divide by a guarded scale; a constant group stores scale 0 and decodes to `zero` exactly.
    denom = scale.float().clamp(min=EPS)
    codes = torch.round((xf - zero.float().unsqueeze(-1)) / denom.unsqueeze(-1))
    codes = codes.clamp_(0, levels).to(torch.uint8)
    return codes, scale, zero


def dequantize_uniform(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """codes (..., n) uint8 (or float32), scale (...,), zero (...,) -> x̂ (..., n) dtype."""
    x = codes.float() * scale.float().unsqueeze(-1)
    x += zero.float().unsqueeze(-1)
    return x.to(dtype)


@functools.lru_cache(maxsize=None)
def _boundary_values(bits: int) -> tuple[float, ...]:
    """The boundaries of :func:`normal_tables` as Python numbers (exactly the float32 ones)."""
    return tuple(_normal_tables(bits)[0].tolist())


@functools.lru_cache(maxsize=None)
def _normal_tables(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard-normal bin boundaries Φ⁻¹(i/2^b), i=1..2^b-1, and centres Φ⁻¹((i+½)/2^b)."""
    n = 2**bits
    i = torch.arange(n, dtype=torch.float64)
    boundaries = torch.special.ndtri(i[1:] / n).float()
    centres = torch.special.ndtri((i + 0.5) / n).float()
    return boundaries, centres


def normal_tables(bits: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(boundaries (2**bits - 1,), centres (2**bits,)) float32 on ``device``.

    Copied to a device once (:func:`prepare_tables`, from a cache's first input), not at every
    kernel launch: a blocking host copy each time, which a CUDA graph being recorded (a
    compiled decode step under ``mode="reduce-overhead"``) refuses. Should a graph record
    before they are there, they are written by fill kernels that it records, and not kept
    (that memory belongs to the graph's pool)."""
    device = torch.device(device)
    if device.type == "cpu":
        return _normal_tables(bits)
    kept = _ON_DEVICE.get((bits, device))
    if kept is not None:
        return kept
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return tuple(filled(t.tolist(), device) for t in _normal_tables(bits))
    return _ON_DEVICE.setdefault((bits, device), tuple(t.to(device) for t in _normal_tables(bits)))


_ON_DEVICE: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
"""The tables on each device they were asked on, by (bits, device)."""


def prepare_tables(device: torch.device | str) -> None:
    """Copy every tier's tables to ``device`` now, from eager code (a cache's first input),
    so that kernel launches, compiled or not, only read them: a first copy inside a compiled
    step's CUDA-graph warm-up would be memory of the graphs' private pool that outlives the
    step, which their checks refuse."""
    device = torch.device(device)
    if device.type != "cpu":
        for bits in (1, 2, 4, 8):
            normal_tables(bits, device)


def filled(values: list[float], device: torch.device) -> torch.Tensor:
    """``values`` (float32 numbers) as a float32 tensor on ``device``, written element by
    element with fill kernels rather than copied from the host."""
    out = torch.empty(len(values), dtype=torch.float32, device=device)
    for i, v in enumerate(values):
        out[i].fill_(v)
    return out


def quantize_normalized(
    x: torch.Tensor, bits: int, meta_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalized (Gaussian) quantization of each group on the last axis.

    x (..., n) float -> codes (..., n) uint8, std (...,), mean (...,) meta_dtype.
    ``z = (x - mean) / std`` is binned at standard-normal quantiles.
    """
    meta_dtype = meta_dtype or x.dtype
    xf = x.float()
    # Group statistics in float64, rounded once to the metadata dtype: any summation order
    # (this one, a Triton kernel's) then gives the same stored metadata.
    x64 = x.double()
    mean64 = x64.mean(dim=-1, keepdim=True)
    mean = mean64.squeeze(-1).to(meta_dtype)
    std = (x64 - mean64).square().mean(dim=-1).sqrt().to(meta_dtype)
    # fix: guarded std; a constant group stores std 0 and decodes to `mean` exactly.
    denom = std.float().clamp(min=EPS)
    z = (xf - mean.float().unsqueeze(-1)) / denom.unsqueeze(-1)
    # the bin of z: how many boundaries are <= z (what torch.bucketize(..., right=True) gives,
    # 5-10x slower on CPU for the one boundary of 1-bit codes, the normalized tier)
    codes = torch.zeros(z.shape, dtype=torch.uint8, device=z.device)
    for boundary in _boundary_values(bits):
        codes.add_(z >= boundary)
    return codes, std, mean


def dequantize_normalized(
    codes: torch.Tensor, std: torch.Tensor, mean: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """codes (..., n) uint8, std (...,), mean (...,) -> x̂ (..., n) dtype."""
    _, centres = normal_tables(bits, codes.device)
    x = centres[codes.long()] * std.float().unsqueeze(-1) + mean.float().unsqueeze(-1)
    return x.to(dtype)


def quantize(x: torch.Tensor, bits: int, method: str, meta_dtype: torch.dtype | None = None):
    """Dispatch to :func:`quantize_uniform` or :func:`quantize_normalized`."""
    if method == UNIFORM:
        return quantize_uniform(x, bits, meta_dtype)
    if method == NORMALIZED:
        return quantize_normalized(x, bits, meta_dtype)
    raise ValueError(f"unknown quantization method {method!r}; expected {UNIFORM!r} or {NORMALIZED!r}")


def dequantize(codes, meta0, meta1, bits: int, method: str, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize` (metadata in the order it returned them)."""
    if method == UNIFORM:
        return dequantize_uniform(codes, meta0, meta1, dtype)
    if method == NORMALIZED:
        return dequantize_normalized(codes, meta0, meta1, bits, dtype)
    raise ValueError(f"unknown quantization method {method!r}; expected {UNIFORM!r} or {NORMALIZED!r}")


# --- layouts: chunks (N, H, G, D) <-> groups on the last axis ---------------------------


def key_groups(chunks: torch.Tensor) -> torch.Tensor:
    """Keys are grouped per channel over the chunk's tokens: (N, H, G, D) -> (N, H, D, G)."""
    return chunks.transpose(-1, -2)


def key_chunks(groups: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`key_groups`: (N, H, D, G) -> (N, H, G, D)."""
    return groups.transpose(-1, -2)


def value_groups(chunks: torch.Tensor, group: int) -> torch.Tensor:
    """Values are grouped per token over ``group`` channels: (N, H, G, D) -> (N, H, G, D//group, group)."""
    *lead, d = chunks.shape
    if d % group:
        raise ValueError(f"head dim {d} is not a multiple of the value channel group {group}")
    return chunks.reshape(*lead, d // group, group)


def value_chunks(groups: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`value_groups`: (N, H, G, D//group, group) -> (N, H, G, D)."""
    return groups.flatten(-2)

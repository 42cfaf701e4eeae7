"""Orthogonal rotations of the head dimension applied before caching (SPEC §1.3 extensions).

Rotating keys and queries by the same orthogonal matrix leaves every score q·k unchanged;
rotating values and then the attention output back leaves the output unchanged. What
changes is what the quantizers see: a channel that carries most of a vector's magnitude
(an outlier channel) is spread over all channels, so a low-bit group's range is no longer
set by one channel and the 2- and 1-bit tiers lose less (QuaRot, arXiv 2404.00456).
"""

from __future__ import annotations

import functools
import math

import torch

HADAMARD = "hadamard"


def hadamard_block(d: int) -> int:
    """Size of the Hadamard blocks used for head dim ``d``: the largest power of two dividing it."""
    if d < 1:
        raise ValueError(f"head dim must be positive, got {d}")
    return d & -d


@functools.lru_cache(maxsize=None)
def _hadamard(d: int, device: torch.device) -> torch.Tensor:
    block = hadamard_block(d)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(block)
    return torch.block_diag(*([h] * (d // block))).float().to(device)


def rotation_matrix(kind: str | None, d: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The (d, d) float32 orthogonal matrix R of ``kind`` (vectors rotate as ``x @ R``), or None.

    "hadamard": a normalized Sylvester Hadamard matrix, block-diagonal over blocks of
    :func:`hadamard_block` (d) channels; symmetric, so it is its own inverse.

    One tensor per (kind, d, device), shared by every layer and every cache: a constant of
    the model like its RoPE tables, not request state, so memory reports do not count it
    (16 KiB for a head dim of 64).
    """
    if kind is None:
        return None
    if kind != HADAMARD:
        raise ValueError(f"unknown rotation {kind!r}; expected None or {HADAMARD!r}")
    return _hadamard(d, torch.device(device))


def rotate(x: torch.Tensor, matrix: torch.Tensor | None) -> torch.Tensor:
    """``x (..., d) @ matrix`` computed in float32, returned in ``x``'s dtype; ``x`` itself when None."""
    if matrix is None:
        return x
    return (x.float() @ matrix).to(x.dtype)


def unrotate(x: torch.Tensor, matrix: torch.Tensor | None) -> torch.Tensor:
    """Inverse of :func:`rotate`: ``x @ matrixᵀ`` in float32, in ``x``'s dtype."""
    if matrix is None:
        return x
    return (x.float() @ matrix.T).to(x.dtype)

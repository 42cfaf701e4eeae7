"""The FP16 tail: the newest ``len % G`` tokens of each row, kept exactly until they fill a chunk.

Shapes: keys/values (B, Hkv, G, D) in the cache's full-precision dtype, lengths (B,) int64;
slots at and beyond a row's length hold nothing the cache reads.
"""

from __future__ import annotations

import torch

from .layer_base import gather_tokens, stable_order


def append(
    tail_k: torch.Tensor, tail_v: torch.Tensor, tail_len: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    new_valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Any number of new tokens (B, Hkv, S, D), padding (``new_valid`` False) skipped.

    -> (chunks_k, chunks_v, chunk_ok, tail_k, tail_v, tail_len): the full chunks that leave the
    tail, (B, F, Hkv, G, D) each with ``chunk_ok`` (B, F) marking the real ones (F is the most
    any row fills, possibly 0), and the new tail. New tensors; one host read (F).
    """
    b, h, g, d = tail_k.shape
    ar = torch.arange(g, device=tail_k.device)
    pending = torch.cat([ar[None, :] < tail_len[:, None], new_valid], dim=1)
    order = stable_order(pending, valid_first=True)
    pk = gather_tokens(torch.cat([tail_k, key.to(tail_k.dtype)], dim=2), order)
    pv = gather_tokens(torch.cat([tail_v, value.to(tail_v.dtype)], dim=2), order)
    n_pending = tail_len + new_valid.sum(1)
    n_full = n_pending // g
    f = int(n_full.max())
    chunks = [x[:, :, : f * g].reshape(b, h, f, g, d).transpose(1, 2) for x in (pk, pv)]
    chunk_ok = torch.arange(f, device=tail_k.device)[None, :] < n_full[:, None]
    index = n_full[:, None] * g + ar
    pk, pv = (torch.nn.functional.pad(x, (0, 0, 0, g)) for x in (pk, pv))
    return chunks[0], chunks[1], chunk_ok, gather_tokens(pk, index), gather_tokens(pv, index), n_pending - n_full * g


def write_one(
    tail_k: torch.Tensor, tail_v: torch.Tensor, tail_len: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token per row (B, Hkv, 1, D) where ``valid`` (B,): in place, with fixed shapes (a
    decode step). A row whose tail is full cannot take it.

    -> (written, overrun), (B,) bool each: the rows that took their token, and the valid rows
    whose full tail did not.
    """
    b, h, g, d = tail_k.shape
    room = tail_len < g
    written = valid & room
    at = tail_len.clamp(max=g - 1)[:, None, None, None].expand(b, h, 1, d)
    for tail, new in ((tail_k, key), (tail_v, value)):
        tail.scatter_(2, at, torch.where(written[:, None, None, None], new.to(tail.dtype), tail.gather(2, at)))
    tail_len += written
    return written, valid & ~room


def as_chunk(tail: torch.Tensor) -> torch.Tensor:
    """A full tail (B, Hkv, G, D) as one chunk per row (B, 1, Hkv, G, D)."""
    return tail[:, None]

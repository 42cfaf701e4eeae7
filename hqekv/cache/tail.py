"""The FP16 tail: the newest ``len % G`` tokens of each row, kept exactly until they fill a chunk.

Shapes: keys/values (B, Hkv, G, D) in the cache's full-precision dtype, lengths (B,) int64;
slots at and beyond a row's length hold nothing the cache reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rows import RowPart, gather_tokens, stable_order


@dataclass
class Tail(RowPart):
    """The tail of every row: ``k``, ``v`` (B, Hkv, G, D), ``length`` (B,) int64."""

    k: torch.Tensor
    v: torch.Tensor
    length: torch.Tensor

    PART = "tail"

    @staticmethod
    def empty(like: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> "Tail":
        """Empty tails for (B, Hkv, S, D) states ``like``, in ``dtype``."""
        b, h, _, d = like.shape
        k = like.new_zeros(b, h, chunk_size, d, dtype=dtype)
        return Tail(k, k.clone(), torch.zeros(b, dtype=torch.long, device=like.device))

    def append(
        self, key: torch.Tensor, value: torch.Tensor, new_valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Any number of new tokens (B, Hkv, S, D), padding (``new_valid`` False) skipped.

        -> (chunks_k, chunks_v, chunk_ok): the full chunks that leave the tail, (B, F, Hkv, G,
        D) each with ``chunk_ok`` (B, F) marking the real ones (F is the most any row fills,
        possibly 0). The tail then holds the rest (new tensors); one host read (F).
        """
        b, h, g, d = self.k.shape
        ar = torch.arange(g, device=self.k.device)
        pending = torch.cat([ar[None, :] < self.length[:, None], new_valid], dim=1)
        order = stable_order(pending, valid_first=True)
        pk = gather_tokens(torch.cat([self.k, key.to(self.k.dtype)], dim=2), order)
        pv = gather_tokens(torch.cat([self.v, value.to(self.v.dtype)], dim=2), order)
        n_pending = self.length + new_valid.sum(1)
        n_full = n_pending // g
        f = int(n_full.max())
        chunks = [x[:, :, : f * g].reshape(b, h, f, g, d).transpose(1, 2) for x in (pk, pv)]
        chunk_ok = torch.arange(f, device=self.k.device)[None, :] < n_full[:, None]
        index = n_full[:, None] * g + ar
        pk, pv = (torch.nn.functional.pad(x, (0, 0, 0, g)) for x in (pk, pv))
        self.k, self.v, self.length = gather_tokens(pk, index), gather_tokens(pv, index), n_pending - n_full * g
        return chunks[0], chunks[1], chunk_ok

    def write_one(self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row (B, Hkv, 1, D) where ``valid`` (B,): in place, with fixed shapes (a
        decode step). A row whose tail is full cannot take it.

        -> (written, overrun), (B,) bool each: the rows that took their token, and the valid rows
        whose full tail did not.
        """
        b, h, g, d = self.k.shape
        room = self.length < g
        written = valid & room
        at = self.length.clamp(max=g - 1)[:, None, None, None].expand(b, h, 1, d)
        for tail, new in ((self.k, key), (self.v, value)):
            tail.scatter_(2, at, torch.where(written[:, None, None, None], new.to(tail.dtype), tail.gather(2, at)))
        self.length += written
        return written, valid & ~room

    def full(self) -> torch.Tensor:
        """The rows whose tail holds a whole chunk (B,) bool."""
        return self.length >= self.k.shape[2]

    def as_chunks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tails as one chunk per row, keys and values (B, 1, Hkv, G, D)."""
        return self.k[:, None], self.v[:, None]

    def clear(self, rows: torch.Tensor) -> None:
        """Empty the tails of ``rows`` (B,) bool, in place (their chunk has left)."""
        self.length.masked_fill_(rows, 0)

    def peak(self) -> torch.Tensor:
        """The largest magnitude the tails hold, float32 0-d (on the device)."""
        return torch.maximum(self.k.abs().amax(), self.v.abs().amax()).float()

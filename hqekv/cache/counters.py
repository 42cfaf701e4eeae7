"""A layer's per-row counters (B,) and flags."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rows import RowPart


@dataclass
class RowCounters(RowPart):
    """Per row (B,): real tokens stored, chunks made (evicted ones included), chunks evicted,
    tokens since the last re-rank, whether a decode step found the tail full, and the row's
    share of ``bavg`` in this layer (``allocation="rate-distortion"``,
    :meth:`hqekv.cache.HqeKVCache.share_budget`)."""

    real_len: torch.Tensor
    n_chunks: torch.Tensor
    n_evicted: torch.Tensor
    since_rerank: torch.Tensor
    overrun: torch.Tensor
    budget_share: torch.Tensor

    PART = "counters"

    @staticmethod
    def start(rows: int, rerank_interval: int, device: torch.device) -> "RowCounters":
        long = dict(dtype=torch.long, device=device)
        return RowCounters(
            torch.zeros(rows, **long),
            torch.zeros(rows, **long),
            torch.zeros(rows, **long),
            torch.full((rows,), rerank_interval, **long),  # the first flush may re-rank
            torch.zeros(rows, dtype=torch.bool, device=device),
            torch.ones(rows, dtype=torch.float64, device=device),
        )

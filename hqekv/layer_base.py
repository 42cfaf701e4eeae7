"""What every hqekv cache layer shares: the logical length and the per-row state that beam
search and batch selection reorder."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin


class RowStateLayer(CacheLayerMixin):
    """A cache layer whose per-row tensors are named in ``ROW_STATE`` (the first one's rows
    give the batch size); ``seen`` is the logical length, padding and evicted tokens included."""

    ROW_STATE: tuple[str, ...] = ()

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen = 0
        self.has_tokens = False
        self.is_initialized = False

    def _map_rows(self, fn) -> None:
        if self.is_initialized:
            for name in self.ROW_STATE:
                setattr(self, name, fn(getattr(self, name)))
            self.batch_size = getattr(self, self.ROW_STATE[0]).shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows may then share pool slots; the next rebuild gives each its own copy."""
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t[indices])

"""What every hqekv cache layer shares: the logical length and the per-row state that beam
search and batch selection reorder."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin


class RowStateLayer(CacheLayerMixin):
    """A cache layer whose per-row tensors are named in ``ROW_STATE`` (the first one's rows
    give the batch size).

    The logical length (padding and evicted tokens included) is ``length``, a 0-d int64
    tensor on the layer's device that forwards advance in place, as transformers'
    ``StaticLayer`` keeps ``cumulative_length``: a compiled decode step reads and advances
    it without a Python int reaching its graph. ``seen`` reads it on the host.
    """

    ROW_STATE: tuple[str, ...] = ()

    def init_length(self, device: torch.device) -> None:
        """Start counting at 0 on ``device`` (called by ``lazy_initialization``)."""
        self.length = torch.zeros((), dtype=torch.long, device=device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.length)  # one address for CUDA graphs

    @property
    def seen(self) -> int:
        """The logical length as a Python int (a host read of ``length``)."""
        return int(self.length) if self.is_initialized else 0

    def advance(self, n_new: int) -> None:
        """Count ``n_new`` more tokens, in place (traceable)."""
        self.length.add_(n_new)

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
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

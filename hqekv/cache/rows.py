"""What every hqekv cache layer shares: the logical length, per-row parts that beam search
and batch selection reorder, the storage capacity strategy, the check of what a layer may
store, and row-wise token gathers.

A *row part* (:class:`RowPart`) is a group of tensors whose first dimension is the batch
row: the chunk table, the FP16 tail, the query window, the counters, a sliding layer's
buffer. A layer lists its parts (:meth:`RowStateLayer.row_parts`); reordering rows, copying
a layer and counting bytes go through them, so each part is named once.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from transformers.cache_utils import CacheLayerMixin

from ..tiers import FP16, QUANTIZED_TIERS


_FLOAT16_MAX = torch.finfo(torch.float16).max


def fits_float16(peak: float) -> bool:
    """Whether a magnitude read from the device is finite and within float16's range."""
    return math.isfinite(peak) and peak <= _FLOAT16_MAX


def check_storable(
    layer_idx, states: tuple[torch.Tensor, ...], store_dtypes: tuple[torch.dtype, ...], position: int | None = None
) -> None:
    """Raise ``ValueError`` at once for key/value states the cache cannot keep faithfully.

    NaN/inf states (the model itself broke) and, when a part is stored in float16 (the
    FP16 tier, tail and window of an fp32 model, or float16 scale/zero), values beyond its
    ±65504 range, which would turn into inf and then NaN logits, silently. An eager check
    (one host sync), run on every prefill and by each layer's ``maintain()`` over what the
    decode steps since its last look stored.
    """
    peak = torch.stack([t.detach().abs().amax().float() if t.numel() else t.new_zeros((), dtype=torch.float32)
                        for t in states]).amax()  # fmt: skip
    peak = float(peak)
    limit = _FLOAT16_MAX
    at = "" if position is None else f" (among the newest tokens, before token {position})"
    fix = (
        "patch with fp_dtype='bfloat16' (or 'float32') and metadata_dtype='bfloat16' (or 'float32')"
    )
    if not math.isfinite(peak):
        cause = f", or exceeded float16's ±{limit:g} when stored ({fix})" if torch.float16 in store_dtypes else ""
        raise ValueError(
            f"non-finite (NaN/inf) key or value states in layer {layer_idx}{at}: the model's own activations "
            f"overflowed or became NaN (the unpatched model would give NaN from here on){cause}"
        )
    if torch.float16 in store_dtypes and peak > limit:
        raise ValueError(
            f"key/value states of magnitude {peak:.4g} in layer {layer_idx}{at} exceed float16's range (±{limit:g}), in "
            f"which this cache stores its full-precision parts or scale/zero; {fix}"
        )


def stable_order(valid: torch.Tensor, valid_first: bool) -> torch.Tensor:
    """Permutation of each row putting valid entries first (or last), order preserved.

    valid (B, L) bool -> (B, L) int64.
    """
    key = (~valid if valid_first else valid).to(torch.int8)
    return key.argsort(dim=1, stable=True)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Tokens of each row by index: x (B, H, L, D), index (B, L') -> (B, H, L', D)."""
    b, h, _, d = x.shape
    return x.gather(2, index[:, None, :, None].expand(b, h, index.shape[1], d))


class RowPart:
    """A dataclass of per-row tensors (first dimension B): the fields, in order, are its
    tensors. ``PART`` names the memory report's part its bytes count in."""

    PART = ""

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def map_rows(self, fn) -> None:
        """Every tensor replaced by ``fn(tensor)`` (new rows: batch selection, repetition)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, fn(getattr(self, f.name)))

    def reorder(self, index: torch.Tensor) -> None:
        """Rows reordered by ``index`` (B,) in place: every address stays (beam search)."""
        for t in self.tensors():
            t.copy_(t.index_select(0, index.to(t.device)))

    def clone(self):
        return type(self)(*(t.clone() for t in self.tensors()))

    @property
    def rows(self) -> int:
        return self.tensors()[0].shape[0]


class Capacity:
    """How a layer's storage is sized: exactly what it holds (:class:`ExactCapacity`), or
    reserved ahead for ``max_length`` tokens per row (:class:`StaticCapacity`, for CUDA
    graphs)."""

    max_length: int | None = None

    def room(self, capacity: int, needed: int) -> int:
        """The slots (or table columns) to hold ``needed`` when ``capacity`` is too few."""
        raise NotImplementedError

    def keeps_addresses(self) -> bool:
        """Whether the tensors a decode step uses keep their addresses (written in place, pinned)."""
        raise NotImplementedError

    def adopt(self, layer, table, pools) -> None:
        """Make ``layer`` hold ``pools`` (component -> ComponentPools) through ``table`` (a
        ChunkTable), a re-rank's result, in place of its chunks."""
        raise NotImplementedError


class ExactCapacity(Capacity):
    """Storage holds exactly what is in use; it moves as the cache grows."""

    def room(self, capacity: int, needed: int) -> int:
        return needed

    def keeps_addresses(self) -> bool:
        return False

    def adopt(self, layer, table, pools) -> None:
        layer.table, layer.pools = table, pools


class StaticCapacity(Capacity):
    """Storage reserved for ``max_length`` tokens per row when the first input is stored,
    written in place, so every tensor a decode step uses keeps its address; what runs out
    of room grows by :data:`GROWTH` (rarely: a CUDA graph then re-records once)."""

    def __init__(self, max_length: int):
        bad = isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
        if bad:
            raise ValueError(f"max_length must be a positive number of tokens or None, got {max_length!r}")
        self.max_length = max_length

    def room(self, capacity: int, needed: int) -> int:
        return max(needed, grown(capacity))

    def keeps_addresses(self) -> bool:
        return True

    def adopt(self, layer, table, pools) -> None:
        """Copied into the layer's own tensors (growing those that lack room): every address
        a decode step uses stays."""
        for component, new in pools.items():
            own = layer.pools[component]
            for t in (FP16, *QUANTIZED_TIERS):
                own.used[t] = 0
                own.store(t, 0, new.in_use(t), self)
        layer.table.assign(table, self)


GROWTH = 1.25
"""Factor by which static storage that runs out of room grows. Each growth moves it (a
CUDA graph re-records once); what it reserves beyond need is real memory. Measured with
SmolLM2, a 4K prompt and 256 new tokens (``benchmarks/static_room.py``): factor 2 left
13.8% (bavg 2) and 12.3% (bavg 3.2) of the cache in reserve at the end, 1.25 left 13.6%
and 10.9%, both with storage moved before 6 and 5 of the 255 decode steps."""


def grown(capacity: int) -> int:
    """The room after one growth of static storage of ``capacity`` slots (or columns)."""
    return max(capacity + 1, math.ceil(capacity * GROWTH))


def capacity_for(max_length: int | None) -> Capacity:
    """:class:`StaticCapacity` for ``max_length`` tokens per row, :class:`ExactCapacity` for None."""
    return ExactCapacity() if max_length is None else StaticCapacity(max_length)


class RowStateLayer(CacheLayerMixin):
    """A cache layer whose per-row state lives in its :meth:`row_parts` (the first one's
    rows give the batch size).

    The logical length (padding and evicted tokens included) is ``length``, a 0-d int64
    tensor on the layer's device that forwards advance in place, as transformers'
    ``StaticLayer`` keeps ``cumulative_length``: a compiled decode step reads and advances
    it without a Python int reaching its graph. ``seen`` reads it on the host.

    ``capacity`` sizes its storage (:func:`capacity_for`): a :class:`StaticCapacity` for
    ``max_length`` tokens reserves its storage when its first input is stored, and every
    tensor a decode step reads or writes keeps its address (changed in place, marked with
    ``torch._dynamo.mark_static_address``) unless storage must grow (rarely, by
    :data:`GROWTH`).
    """

    split = 1
    """Storage rows per batch row: 1, or a layer's KV heads when each head is a row of its own
    (``config.head_tiers``, :class:`~hqekv.cache.HqeKVLayer`). ``batch_size`` and
    ``num_kv_heads`` count storage rows and the KV heads of each; :attr:`rows` and
    :attr:`model_kv_heads` the model's."""

    def __init__(self, max_length: int | None = None):
        super().__init__()
        self.capacity = capacity_for(max_length)

    @property
    def rows(self) -> int:
        """The batch rows (of the model's input) this layer holds."""
        return self.batch_size // self.split

    @property
    def model_kv_heads(self) -> int:
        """The model's KV heads per batch row."""
        return self.num_kv_heads * self.split

    def storage_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Storage rows of the batch rows ``index`` (N,) -> (N·split,), each row's in order."""
        if self.split == 1:
            return index
        heads = torch.arange(self.split, device=index.device)
        return (index[:, None] * self.split + heads).flatten()

    @property
    def max_length(self) -> int | None:
        return self.capacity.max_length

    def row_parts(self) -> list[RowPart]:
        """The parts holding this layer's per-row tensors."""
        raise NotImplementedError

    def init_length(self, device: torch.device) -> None:
        """Start counting at 0 on ``device``, and looking at the device as :meth:`time_to_look`
        says (called by ``lazy_initialization``)."""
        self.length = torch.zeros((), dtype=torch.long, device=device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.length)  # one address for CUDA graphs
        self.unchecked_steps = 0  # maintain() calls since its last look at the device
        self.look_every_step = device.type == "cpu"  # where a host read costs no sync

    def decode_tensors(self) -> list[torch.Tensor]:
        """Every tensor a decode step reads or writes: the per-row tensors and the length."""
        return [*(t for part in self.row_parts() for t in part.tensors()), self.length]

    def check_fits(self, key: torch.Tensor) -> None:
        """``ValueError`` when keys (B, Hkv, S, D) do not fit this initialized layer's rows,
        KV heads and head dim."""
        if self.is_initialized and (
            key.shape[0] != self.rows or key.shape[1] != self.model_kv_heads or key.shape[3] != self.head_dim
        ):
            raise ValueError(
                f"keys of shape {tuple(key.shape)} do not fit a cache of {self.rows} rows, "
                f"{self.model_kv_heads} KV heads, head dim {self.head_dim}"
            )

    def pin(self) -> None:
        """Mark :meth:`decode_tensors` as static addresses (a static layer, after it stored an
        input or its storage grew)."""
        if torch.compiler.is_compiling() or not self.capacity.keeps_addresses():
            return
        for t in self.decode_tensors():
            torch._dynamo.mark_static_address(t)

    def time_to_look(self, every: int) -> bool:
        """Count a ``maintain()`` call; whether it should read the device (one host sync): at
        every call on a CPU, elsewhere once ``every`` calls have passed since the last look."""
        self.unchecked_steps += 1
        if self.unchecked_steps < every and not self.look_every_step:
            return False
        self.unchecked_steps = 0
        return True

    @property
    def seen(self) -> int:
        """The logical length as a Python int (a host read of ``length``)."""
        return int(self.length) if self.is_initialized else 0

    def advance(self, n_new: int) -> None:
        """Count ``n_new`` more tokens, in place (traceable)."""
        self.length.add_(n_new)

    def get_seq_length(self) -> int:
        return self.seen

    def copy(self):
        """An independent copy: the row parts and the length cloned, the rest shared
        (calibration scores trials from one prefill)."""
        layer = copy.copy(self)
        if self.is_initialized:
            layer._adopt_parts([part.clone() for part in self.row_parts()])
            layer.length = self.length.clone()
        return layer

    def _adopt_parts(self, parts: list[RowPart]) -> None:
        """Hold ``parts`` in place of :meth:`row_parts` (same order; :meth:`copy`)."""
        raise NotImplementedError

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.has_tokens = False
        self.is_initialized = False

    def _map_rows(self, fn) -> None:
        if self.is_initialized:
            for part in self.row_parts():
                part.map_rows(fn)
            self.batch_size = self.row_parts()[0].rows
            self.pin()  # new rows, new tensors: a CUDA graph re-records once

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """In place (addresses stay). Rows may then share pool slots; the next rebuild gives
        each its own copy."""
        if self.is_initialized:
            index = self.storage_rows(beam_idx.to(self.device))
            for part in self.row_parts():
                part.reorder(index)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.batch_select_indices(torch.arange(self.rows, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            index = torch.as_tensor(indices, device=self.device)
            if index.dtype == torch.bool:
                index = index.nonzero().flatten()
            rows = self.storage_rows(index)
            self._map_rows(lambda t: t[rows])

"""One global attention layer's compressed cache: :class:`HqeKVLayer`, composed of parts
that own their state (``docs/architecture.md`` draws them):

- ``pools``: per component, the chunk slots of each tier (:mod:`hqekv.cache.pools`);
- ``table``: where each kept chunk's keys and values lie (:mod:`hqekv.cache.table`);
- ``tail``: the FP16 tail of the newest ``len % G`` tokens (:mod:`hqekv.cache.tail`);
- ``query_window``: the last m queries, which re-ranking scores importance with;
- ``counters``: per-row counters, and the logical length (:mod:`hqekv.cache.rows`);
- ``capacity``: storage sized exactly, or reserved ahead for CUDA graphs.

Attention reads the storage as one :class:`~hqekv.cache.view.CacheView`; re-ranking is
:mod:`hqekv.cache.rerank`. This module keeps transformers' CacheLayerMixin contract, stores
new tokens, moves full tails into FP16 chunks and decides when to re-rank. With
``config.rotation`` set, keys, values and window queries are stored in a rotated basis
(:mod:`hqekv.rotation`) and the output rotated back. Keys are cached after RoPE: the layer
reports the logical length to the model, and attention runs over the physical tokens. A
decode step writes its token into the tail with fixed shapes (one graph under
``torch.compile``); flushing and re-ranking happen in :meth:`HqeKVLayer.maintain`, eager.
"""

from __future__ import annotations

import torch

from ..config import HqeKVConfig
from ..quantization import prepare_tables
from ..rotation import rotate, rotation_matrix, unrotate
from ..tiers import FP16, QUANTIZED_TIERS, TIER_NAMES
from . import rerank, room
from .counters import RowCounters
from .pools import KEY, VALUE, ComponentPools
from .query_window import QueryWindow
from .rows import RowStateLayer, check_storable, fits_float16
from .table import ChunkTable
from .tail import Tail
from .view import CacheView


def split_heads(x: torch.Tensor, split: int) -> torch.Tensor:
    """(B, H, S, D) states as (B·split, H/split, S, D): each of ``split`` groups of heads a row
    (query heads grouped as the KV heads they read)."""
    b, h, s, d = x.shape
    return x.reshape(b * split, h // split, s, d)


def merge_heads(out: torch.Tensor, split: int) -> torch.Tensor:
    """Attention outputs (B·split, S, Hq/split, D) of :func:`split_heads`' rows as (B, S, Hq, D)."""
    if split == 1:
        return out
    bs, s, h, d = out.shape
    return out.reshape(bs // split, split, s, h, d).transpose(1, 2).reshape(bs // split, s, split * h, d)


class HqeKVLayer(RowStateLayer):
    """One attention layer's mixed-precision cache (SPEC §1.3–§1.4).

    Use through :meth:`attend`, which the patched attention calls: it attends the new
    queries over the cache plus the new tokens, then stores the new tokens (FP16 tail,
    flushed into FP16 chunks) and re-ranks every ``rerank_interval`` tokens.
    """

    is_compileable = True
    is_sliding = False
    is_croppable = False

    def __init__(self, config: HqeKVConfig, layer_idx: int | None = None, max_length: int | None = None):
        super().__init__(max_length)
        self.config = config
        self.layer_idx = layer_idx
        self.has_tokens = False
        self.deferring = False  # a prompt arrives in pieces: evict nothing yet (HqeKVCache.defer_eviction)

    def row_parts(self) -> list:
        return [self.table, self.tail, self.query_window, self.counters]

    def _adopt_parts(self, parts) -> None:
        self.table, self.tail, self.query_window, self.counters = parts

    # --- CacheLayerMixin contract ----------------------------------------------------------

    def lazy_initialization(
        self, key_states: torch.Tensor, value_states: torch.Tensor, query_states: torch.Tensor | None = None
    ) -> None:
        cfg = self.config
        b, h, _, d = key_states.shape
        hq = query_states.shape[1] if query_states is not None else h
        g = cfg.chunk_size
        self.device, self.dtype = key_states.device, key_states.dtype
        self.init_length(self.device)
        self.meta_dtype = cfg.resolve_metadata_dtype(self.dtype)
        self.fp_dtype = cfg.resolve_fp_dtype(self.dtype)  # FP16 chunks, tail, window queries
        self.rotation = rotation_matrix(cfg.rotation, d, self.device)  # (D, D) float32 or None
        prepare_tables(self.device)  # the kernels' quantile tables on the device, before any compiled step
        self.value_group = min(cfg.value_group, d)
        if d % self.value_group:
            raise ValueError(f"head dim {d} is not a multiple of the value channel group {self.value_group}")
        self.batch_size, self.num_kv_heads, self.head_dim = b, h, d
        self.pools = {
            c: ComponentPools.empty(key_states, c, g, self.value_group, self.fp_dtype, self.meta_dtype)
            for c in (KEY, VALUE)
        }
        self.table = ChunkTable.empty(b, self.device)
        self.tail = Tail.empty(key_states, g, self.fp_dtype)
        self.query_window = QueryWindow.empty(key_states, hq, cfg.window, self.fp_dtype)
        self.counters = RowCounters.start(b, cfg.rerank_interval, self.device)
        self.pending = None  # choices of a multi-token input's re-rank, until the cache shares the budget
        self.decoded = False  # decode steps wrote tail tokens that maintain() has not yet checked
        self.headroom = 0  # decode steps before any tail can be full, as of the last look at the tails
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError(
            "HqeKVLayer stores a compressed cache and cannot return dense keys/values; attention must go "
            "through a model patched with hqekv.patch_model (HqeKVLayer.attend)."
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an HqeKV cache cannot be cropped: quantized and evicted tokens cannot be restored")

    # --- attention ---------------------------------------------------------------------------

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        new_valid: torch.Tensor | None = None,
        dense_attention=None,
    ) -> torch.Tensor:
        """Attention of the new tokens over the cache, then store them.

        query (B, Hq, S, D), key/value (B, Hkv, S, D) after RoPE; new_valid (B, S) bool, False
        for padding. ``dense_attention(q, k, v) -> (B, S, Hq, D)`` is the model's own attention,
        used while the cache is empty so that the prefill is exactly the unpatched one.
        -> (B, S, Hq, D).

        A decode step (one token, cache not empty) is one graph under ``torch.compile``: the
        ``hqekv::mixed_attention`` op, then the token written into the FP16 tail with fixed
        shapes. Flushing a full tail and re-ranking happen in :meth:`maintain`, which only
        :meth:`HqeKVCache.maintain` runs (before each forward of a patched model, and between
        ``generate``'s steps). Other inputs store eagerly. With ``config.head_tiers`` the
        states are stored with each KV head as a row of its own (:func:`split_heads`), and
        the output regrouped (:func:`merge_heads`).
        """
        b, _, s, _ = key.shape
        if s == 0:
            raise ValueError("empty input: at least one token is needed")
        if new_valid is None:
            new_valid = torch.ones(b, s, dtype=torch.bool, device=key.device)
        if new_valid.shape != (b, s):
            raise ValueError(f"padding mask of shape {tuple(new_valid.shape)} does not match {b} rows × {s} tokens")
        self.check_fits(key)
        if self.is_initialized and key.dtype != self.dtype:
            raise ValueError(
                f"layer {self.layer_idx}: this cache holds the {self.dtype} states of a request begun in {self.dtype}, "
                f"and the model now gives {key.dtype} (model.to(...) since?): continue a cache in the dtype it began "
                "in, or start a new one"
            )
        self.scaling = scaling
        dense = None
        if not self.has_tokens and dense_attention is not None:
            dense = dense_attention(query, key, value)  # unrotated: exactly the unpatched prefill
        split = key.shape[1] if self.config.head_tiers else 1  # each KV head a row of its own
        if split > 1:
            query, key, value = split_heads(query, split), split_heads(key, split), split_heads(value, split)
            new_valid = new_valid.repeat_interleave(split, 0)
        if not self.has_tokens and not self.is_initialized:
            self._initialize(query, key, value)
            self.split = split
        r = self.rotation
        q_r, k_r, v_r = rotate(query, r), rotate(key, r), rotate(value, r)  # the cache's basis
        if not self.has_tokens:
            out = dense if dense is not None else unrotate(self.view().attend(q_r, k_r, v_r, new_valid, self.scaling), r)
            self._store(q_r, k_r, v_r, new_valid)
            return out if dense is not None else merge_heads(out, split)
        out = unrotate(self.view().attend(q_r, k_r, v_r, new_valid, self.scaling), r)
        if s == 1:
            # a row whose full tail could not take an earlier token lost it: NaN, never a plausible answer
            out = out.masked_fill(self.counters.overrun[:, None, None, None], float("nan"))
            self._store_decode_token(q_r, k_r, v_r, new_valid)
        else:
            self._store(q_r, k_r, v_r, new_valid)
        return merge_heads(out, split)

    @torch.compiler.disable
    def _initialize(self, query, key, value) -> None:
        self.lazy_initialization(key, value, query)

    def view(self, table: ChunkTable | None = None) -> CacheView:
        """This layer's storage read as one view (through ``table`` when given: its live table)."""
        return CacheView(self.pools, self.table if table is None else table, self.tail, self.value_group)

    def live_table(self) -> ChunkTable:
        """The chunk table without the empty columns a static cache keeps for chunks to come
        (one host read; eager code: re-ranking, the dequantized view)."""
        return self.table.live()

    @torch.compiler.disable
    def _store(self, query, key, value, new_valid) -> None:
        """Store a whole input eagerly: window, tail, flush of full chunks, re-ranking when due."""
        check_storable(self.layer_idx, (key, value), (self.fp_dtype, self.meta_dtype))
        with torch.no_grad():
            self._append(query.detach(), key.detach(), value.detach(), new_valid)
        self.has_tokens = True
        self.headroom = 0  # the tails changed by more than a token: look at them after the next decode step
        if self.capacity.keeps_addresses():
            room.reserve(self, room.planned_room(self))
        self._mark_for_compile()

    def _mark_for_compile(self) -> None:
        """Tell ``torch.compile`` that pool sizes and table widths vary, so they never cause a recompile.

        They reach a compiled graph only as inputs of the opaque ``hqekv::mixed_attention`` op,
        whose output shape does not depend on them: marked unbacked, they are not specialized
        and the decode graph is compiled once (the tables column-major, so that no stride holds
        their width: inductor's CUDA-graph checks ask whether a stride is 0). A static cache
        also pins every tensor a decode step reads or writes (:meth:`RowStateLayer.pin`).
        """
        for component in (KEY, VALUE):
            self.pools[component].mark_dynamic()
        self.table.mark_dynamic()
        self.pin()

    def decode_tensors(self) -> list[torch.Tensor]:
        """Every tensor a decode step reads or writes: the per-row tensors, the length and the pools."""
        return [*super().decode_tensors(), *self.pools[KEY].tensors(), *self.pools[VALUE].tensors()]

    def _store_decode_token(self, query, key, value, new_valid) -> None:
        """Write one token per row into the tail and the query window, with fixed shapes.

        The tail has room when :meth:`maintain` ran since the last step; a row whose tail is
        full keeps its tail and is marked ``overrun`` (NaN output, an error at the next
        :meth:`maintain`).
        """
        counters = self.counters
        with torch.no_grad():
            written, overrun = self.tail.write_one(key, value, new_valid[:, 0])
            counters.overrun |= overrun
            self.query_window.push_one(query, counters.real_len, written)
            counters.real_len += written
            counters.since_rerank += written
        self.decoded = True

    def maintain(self) -> None:
        """Flush full tails into FP16 chunks and re-rank the rows that are due (SPEC §1.4); eager.

        A decode step leaves a tail of G tokens in place; this moves it into the chunk table
        before the next token is stored (the patched model and ``generate`` call it before
        every step). Each decode step adds at most one token to a tail, so the host knows
        how many steps must pass before any tail can be full: only then does it look at the
        tails (one host sync, about once per G tokens), check what the decode steps stored
        (:func:`check_storable`) and flush. On a CPU, where reading a tensor costs no sync,
        every step is checked, so a NaN or an overflow raises before the next token.
        """
        if not self.is_initialized or not self.decoded:
            return
        self.decoded = False
        if not self.time_to_look(self.headroom):
            return
        g = self.config.chunk_size
        tail_len = self._look()
        self.headroom = g - max((n for n in tail_len if n < g), default=0)
        if max(tail_len) < g:
            return
        full = self.tail.full()
        with torch.no_grad():
            self._add_fp16_chunks(*self.tail.as_chunks(), full[:, None])
            self.tail.clear(full)
            due = full & (self.counters.since_rerank >= self.config.rerank_interval)
            if bool(due.any()):
                self.rerank(due)
        self._mark_for_compile()

    def _look(self) -> list[int]:
        """The one host sync of :meth:`maintain`: each row's tail length, after checking what
        the decode steps stored and that none of them found a full tail."""
        overrun = self.counters.overrun
        *tail_len, peak, any_overrun = torch.cat(
            [self.tail.length.float(), self.tail.peak()[None], overrun.any().float()[None]]
        ).tolist()
        if any_overrun:
            rows = sorted(set((overrun.nonzero().flatten() // self.split).tolist()))
            raise RuntimeError(
                f"layer {self.layer_idx}: decode steps ran without HqeKVCache.maintain() between them, and the full "
                f"FP16 tail of rows {rows} could not take a token (their outputs since are NaN); call cache.maintain() "
                "before each decode step of a compiled model (generate does it)"
            )
        if not fits_float16(peak):
            check_storable(self.layer_idx, (self.tail.k, self.tail.v), (self.fp_dtype, self.meta_dtype), self.seen)
        return [int(n) for n in tail_len]

    # --- storage -------------------------------------------------------------------------------

    def physical_cache(
        self, new_keys: torch.Tensor | None = None, new_values: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept tokens, dequantized: chunks, then the tail, then ``new_*`` (B, H, S, D) if given.

        In the cache's basis: rotated when ``config.rotation`` is set (``new_*`` must be too).

        -> keys, values (B, H, C·G + G + S, D) model dtype, positions (B, C·G + G) int64 (index
        of each cached token within its sequence), valid (B, C·G + G) bool.
        """
        keys, values, positions, valid = self.view(self.live_table()).dequantized(self.counters.n_chunks, self.dtype)
        if new_keys is not None:
            keys, values = torch.cat([keys, new_keys], dim=2), torch.cat([values, new_values], dim=2)
        return keys, values, positions, valid

    def _append(self, query, key, value, new_valid) -> None:
        """Window, tail, flush of full chunks into FP16 slots, and re-ranking when due."""
        counters = self.counters
        n_new = new_valid.sum(1)
        positions = counters.real_len[:, None] + new_valid.long().cumsum(1) - 1
        self.query_window.append(query, positions, new_valid)
        chunks_k, chunks_v, chunk_ok = self.tail.append(key, value, new_valid)
        if chunk_ok.shape[1]:
            self._add_fp16_chunks(chunks_k, chunks_v, chunk_ok)
        counters.real_len = counters.real_len + n_new
        counters.since_rerank = counters.since_rerank + n_new
        due = chunk_ok.any(1) & (counters.since_rerank >= self.config.rerank_interval)
        if bool(due.any()):
            # within the forward, a prompt's piece too: it leaves FP16 (to its waiting tier)
            # before the next layer runs, so the layers never hold their pieces in FP16 at
            # once (at depth those outweigh one layer's re-rank transient; docs/results.md)
            self.rerank(due, provisional=True)

    def _add_fp16_chunks(self, fk: torch.Tensor, fv: torch.Tensor, ok: torch.Tensor) -> None:
        """Append new chunks (B, F, H, G, D) where ``ok`` (B, F) to the FP16 pools and chunk tables.

        Each component's new slots follow its own FP16 slots in use: K and V hold different
        numbers once re-ranks have moved some chunks of one component down and not the other's.
        """
        rows, cols = ok.nonzero(as_tuple=True)
        slots = [self.pools[c].append_fp16(new[rows, cols].to(self.fp_dtype), self.capacity)
                 for c, new in ((KEY, fk), (VALUE, fv))]  # fmt: skip
        self.table.append_fp16(ok, self.counters.n_chunks, *slots, self.capacity)
        self.counters.n_chunks += ok.sum(1)

    def copy(self, chunks: bool = True) -> "HqeKVLayer":
        """An independent copy of this layer's state (calibration scores trials from one prefill).

        With ``chunks=False`` the copy shares the pools, for a caller that replaces them
        (:meth:`set_chunks`) before any use.
        """
        layer = super().copy()
        if self.is_initialized:
            layer.pools = {c: p.clone() if chunks else p for c, p in self.pools.items()}
        return layer

    def set_chunks(self, table: ChunkTable, pools: dict[str, ComponentPools]) -> None:
        """Hold ``pools`` through ``table`` in place of the current chunks (:mod:`hqekv.cache.rerank`),
        as the capacity does it (:meth:`~hqekv.cache.rows.Capacity.adopt`)."""
        self.capacity.adopt(self, table, pools)
        self._mark_for_compile()

    def rerank(self, rows: torch.Tensor, provisional: bool = False) -> None:
        """Re-rank the chunks of ``rows`` (B,) bool (:func:`hqekv.cache.rerank.rerank`)."""
        rerank.rerank(self, rows, provisional)

    # --- accounting ----------------------------------------------------------------------------

    def storage(self) -> dict[str, int]:
        """Real bytes of everything this layer stores, by part.

        The rotation matrix is not counted: one constant shared by every layer and cache.
        """
        if not self.is_initialized:
            return {}
        out = {f"{comp}.{tier}": n for comp in (KEY, VALUE) for tier, n in self.pools[comp].nbytes().items()}
        for part in self.row_parts():
            out[part.PART] = part.nbytes()
        out["counters"] += self.length.nbytes
        # a static cache's room for chunks to come: free pool slots and empty table columns
        empty_columns = self.table.nbytes() - self.table.live_nbytes()
        out["tables"] -= empty_columns
        out["reserve"] = empty_columns + sum(self.pools[comp].reserve_nbytes() for comp in (KEY, VALUE))
        return out

    def chunk_counts(self) -> dict[str, int]:
        """Kept chunks per tier and component, evicted chunks and tail tokens, over all rows."""
        valid = self.table.kept()
        out = {}
        for comp, tier in ((KEY, self.table.k_tier), (VALUE, self.table.v_tier)):
            for t in (FP16, *QUANTIZED_TIERS):
                out[f"{comp}.{TIER_NAMES[t]}"] = int((valid & (tier == t)).sum())
        out["evicted"] = int(self.counters.n_evicted.sum())
        out["tail_tokens"] = int(self.tail.length.sum()) // self.split  # a token's heads are rows of their own
        out["real_tokens"] = int(self.counters.real_len.sum()) // self.split
        return out

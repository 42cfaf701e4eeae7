"""The HqeKV cache: one :class:`HqeKVLayer` per global attention layer, composed of parts.

A layer holds *all* request state of its attention layer (SPEC §1.4 fix: nothing lives on
modules or globals):

- ``pools``: per component, the chunk slots of each tier (:mod:`hqekv.pools`);
- the chunk table (B, C) (:class:`hqekv.rerank.ChunkTable`): logical chunk index, K tier
  and slot, V tier and slot of each kept chunk of each sequence, compacted to the left;
  -1 marks an empty entry. Evicted chunks are physically gone;
- the FP16 tail (B, Hkv, G, D) of the newest ``len % G`` tokens of each sequence
  (:mod:`hqekv.tail`);
- the window of the last m queries (after RoPE) that re-ranking scores importance with
  (:mod:`hqekv.window`);
- per-row counters, and the logical length (:class:`hqekv.layer_base.RowStateLayer`).

The work is done by the parts' modules: attention over the view in :mod:`hqekv.attention`,
importance in :mod:`hqekv.importance`, re-ranking's policy and re-quantization in
:mod:`hqekv.rerank`, byte accounting in :mod:`hqekv.memory`. This module keeps the
CacheLayerMixin contract and the parts' state, moves full tails into FP16 chunks and
decides when to re-rank.

With ``config.rotation`` set, everything above is stored in a rotated basis: keys, values
and window queries are multiplied by one orthogonal (D, D) matrix R before they are cached
(:mod:`hqekv.rotation`), queries by R before attention, and the output by Rᵀ after it, so
attention is unchanged and only the quantizers see rotated vectors.

Positions stay absolute (keys are cached after RoPE): the cache reports the logical
length to the model, and attention runs over the physical tokens.

A decode step writes its token into the tail with fixed shapes, so it compiles to one
graph; a tail that fills up becomes a chunk, and re-ranking happens, in
:meth:`HqeKVLayer.maintain`, an eager step run between steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

from . import allocation, attention, importance, policy, rerank, tail, window
from .config import HqeKVConfig
from .layer_base import RowStateLayer, check_storable, fits_float16
from .memory import cache_report
from .pools import KEY, VALUE, ComponentPools, grown
from .quantization import prepare_tables
from .rerank import ChunkTable
from .rotation import rotate, rotation_matrix, unrotate
from .sliding import SlidingWindowLayer
from .tiers import EVICTED, FP16, INT1, QUANTIZED_TIERS, RERANK_TILE_CHUNKS, TIER_NAMES


DEFER_EVICTION = True
"""While a prompt arrives in pieces (:meth:`HqeKVCache.defer_eviction`), re-ranks quantize but
evict nothing until :meth:`HqeKVCache.settle` ranks with the prompt's last queries; False
evicts at every piece's re-rank (an ablation)."""
WAITING = "int4"
"""Under fixed ratios, the tier a chunk waits at while eviction is deferred
(:data:`hqekv.rerank.WAITING_TIERS`): "int4", at most 4 bits (the default), "above" the
policy's, or "at" it (ablations)."""
HELD_TILE_BYTES = 2**24
"""A re-rank's passes over a layer share one dequantized copy of its cache when that copy
(keys and values) holds at most this many bytes (:meth:`HqeKVLayer.tile_reader`): decode
re-ranks of short caches read the pools once instead of once per pass."""

_ROW_PARTS = {
    "tables": ("chunk_pos", "k_tier", "k_slot", "v_tier", "v_slot"),
    "tail": ("tail_k", "tail_v", "tail_len"),
    "window": ("win_q", "win_pos", "win_valid"),
    "counters": ("real_len", "n_chunks", "n_evicted", "since_rerank", "overrun", "budget_share"),
}
"""The per-row tensors of a layer by the part of the memory report they count in; the one
list that reordering rows, copying a layer and byte accounting all read."""
_ROW_STATE = tuple(name for names in _ROW_PARTS.values() for name in names)


def _finite(x: torch.Tensor) -> bool:
    """Whether ``x`` holds no NaN and no infinity (its extremes do: a NaN propagates to both)."""
    return x.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())


def _column_major(table: torch.Tensor) -> torch.Tensor:
    """A (B, C) chunk table with strides (1, B): the same values, its width C in no stride."""
    b, c = table.shape
    if table.stride() == (1, b):
        return table
    out = torch.empty_strided((b, c), (1, b), dtype=table.dtype, device=table.device)
    return out.copy_(table)


class HqeKVLayer(RowStateLayer):
    """One attention layer's mixed-precision cache (SPEC §1.3–§1.4).

    Use through :meth:`attend`, which the patched attention calls: it attends the new
    queries over the cache plus the new tokens, then stores the new tokens (FP16 tail,
    flushed into FP16 chunks) and re-ranks every ``rerank_interval`` tokens.
    """

    is_compileable = True
    is_sliding = False
    is_croppable = False
    ROW_STATE = _ROW_STATE

    def __init__(self, config: HqeKVConfig, layer_idx: int | None = None, max_length: int | None = None):
        super().__init__(max_length)
        self.config = config
        self.layer_idx = layer_idx
        self.has_tokens = False
        self.deferring = False  # a prompt arrives in pieces: evict nothing yet (HqeKVCache.defer_eviction)

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
        long = dict(dtype=torch.long, device=self.device)
        self.chunk_pos = torch.full((b, 0), -1, **long)
        self.k_tier, self.k_slot = self.chunk_pos.clone(), self.chunk_pos.clone()
        self.v_tier, self.v_slot = self.chunk_pos.clone(), self.chunk_pos.clone()
        self.tail_k = key_states.new_zeros(b, h, g, d, dtype=self.fp_dtype)
        self.tail_v = value_states.new_zeros(b, h, g, d, dtype=self.fp_dtype)
        self.tail_len = torch.zeros(b, **long)
        self.win_q = key_states.new_zeros(b, hq, cfg.window, d, dtype=self.fp_dtype)
        self.win_pos = torch.zeros(b, cfg.window, **long)
        self.win_valid = torch.zeros(b, cfg.window, dtype=torch.bool, device=self.device)
        self.real_len = torch.zeros(b, **long)
        self.n_chunks = torch.zeros(b, **long)
        self.n_evicted = torch.zeros(b, **long)
        self.since_rerank = torch.full((b,), cfg.rerank_interval, **long)
        self.overrun = torch.zeros(b, dtype=torch.bool, device=self.device)  # a decode step found the tail full
        # allocation="rate-distortion": each row's share of bavg in this layer (HqeKVCache.share_budget)
        self.budget_share = torch.ones(b, dtype=torch.float64, device=self.device)
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
        shapes. Flushing a full tail and re-ranking happen in :meth:`maintain`, an eager step
        the patched model runs before each forward. Other inputs store eagerly.
        """
        b, _, s, _ = key.shape
        if s == 0:
            raise ValueError("empty input: at least one token is needed")
        if new_valid is None:
            new_valid = torch.ones(b, s, dtype=torch.bool, device=key.device)
        if new_valid.shape != (b, s):
            raise ValueError(f"padding mask of shape {tuple(new_valid.shape)} does not match {b} rows × {s} tokens")
        if self.is_initialized and (
            key.shape[0] != self.batch_size or key.shape[1] != self.num_kv_heads or key.shape[3] != self.head_dim
        ):
            raise ValueError(
                f"keys of shape {tuple(key.shape)} do not fit a cache of {self.batch_size} rows, "
                f"{self.num_kv_heads} KV heads, head dim {self.head_dim}"
            )
        if self.is_initialized and key.dtype != self.dtype:
            raise ValueError(
                f"layer {self.layer_idx}: this cache holds the {self.dtype} states of a request begun in {self.dtype}, "
                f"and the model now gives {key.dtype} (model.to(...) since?): continue a cache in the dtype it began "
                "in, or start a new one"
            )
        self.scaling = scaling
        if not self.has_tokens and not self.is_initialized:
            self._initialize(query, key, value)
        r = self.rotation
        q_r, k_r, v_r = rotate(query, r), rotate(key, r), rotate(value, r)  # the cache's basis
        if not self.has_tokens:
            if dense_attention is not None:
                out = dense_attention(query, key, value)  # unrotated: exactly the unpatched prefill
            else:
                out = unrotate(self._mixed_attention(q_r, k_r, v_r, new_valid), r)
            self._store(q_r, k_r, v_r, new_valid)
            return out
        if not torch.compiler.is_compiling():
            self.maintain()
        out = unrotate(self._mixed_attention(q_r, k_r, v_r, new_valid), r)
        if s == 1:
            # a row whose full tail could not take an earlier token lost it: NaN, never a plausible answer
            out = out.masked_fill(self.overrun[:, None, None, None], float("nan"))
            self._store_decode_token(q_r, k_r, v_r, new_valid)
        else:
            self._store(q_r, k_r, v_r, new_valid)
        return out

    @torch.compiler.disable
    def _initialize(self, query, key, value) -> None:
        self.lazy_initialization(key, value, query)

    def _mixed_attention(self, query, key, value, new_valid) -> torch.Tensor:
        """Attention over this layer's view plus the new tokens (:func:`hqekv.attention.attend`)."""
        return attention.attend(
            query, key, value, new_valid, self.pools, self.table, self.tail_k, self.tail_v, self.tail_len,
            self.scaling, self.value_group,
        )  # fmt: skip

    @property
    def table(self) -> ChunkTable:
        return ChunkTable(self.chunk_pos, self.k_tier, self.k_slot, self.v_tier, self.v_slot)

    def live_table(self) -> ChunkTable:
        """The chunk tables without the empty columns a static cache keeps for chunks to come
        (one host read; eager code: re-ranking, the dequantized view)."""
        width = int((self.chunk_pos >= 0).sum(1).max()) if self.chunk_pos.numel() else 0
        if width == self.chunk_pos.shape[1]:
            return self.table
        return ChunkTable(*(t[:, :width] for t in self.table))

    def _set_table(self, table: ChunkTable) -> None:
        self.chunk_pos, self.k_tier, self.k_slot, self.v_tier, self.v_slot = table

    @torch.compiler.disable
    def _store(self, query, key, value, new_valid) -> None:
        """Store a whole input eagerly: window, tail, flush of full chunks, re-ranking when due."""
        check_storable(self.layer_idx, (key, value), (self.fp_dtype, self.meta_dtype))
        with torch.no_grad():
            self._append(query.detach(), key.detach(), value.detach(), new_valid)
        self.has_tokens = True
        self.headroom = 0  # the tails changed by more than a token: look at them after the next decode step
        if self.static:
            self._reserve(self._planned_room())
        self._mark_for_compile()

    def _mark_for_compile(self) -> None:
        """Tell ``torch.compile`` that pool sizes and table widths vary, so they never cause a recompile.

        They only reach a compiled graph as inputs of the opaque ``hqekv::mixed_attention`` op,
        whose output shape does not depend on them; marked unbacked, they are not specialized
        (not even at 0 or 1) and the decode graph is compiled once. The tables are kept
        column-major, so that their unbacked width is no stride either: inductor's CUDA-graph
        checks ask whether an input's stride is 0, which an unbacked stride cannot answer. A
        static cache also marks every tensor a decode step reads or writes as a static address
        (CUDA graphs replay over them without copies; :meth:`RowStateLayer.pin`).
        """
        for component in (KEY, VALUE):
            for t in self.pools[component].op_order():
                torch._dynamo.decorators.mark_unbacked(t, 0)
        self._set_table(ChunkTable(*(_column_major(t) for t in self.table)))
        for t in self.table:
            torch._dynamo.decorators.mark_unbacked(t, 1)
        if self.static:
            self.pin()

    def decode_tensors(self) -> list[torch.Tensor]:
        """Every tensor a decode step reads or writes: the per-row tensors, the length and the pools."""
        return [*super().decode_tensors(), *self.pools[KEY].tensors(), *self.pools[VALUE].tensors()]

    # --- room: the capacity of a static cache ------------------------------------------------

    def _planned_room(self) -> tuple[dict[str, dict[int, int]], int]:
        """Slots per component and tier, and the chunk-table width, that ``max_length`` tokens
        in every row need under this layer's ratios: the policy's tier counts at that length;
        in FP16 also the protected chunks and the chunks flushed since the last re-rank (a
        re-rank comes at the first flush ``rerank_interval`` tokens after the one before);
        two chunks of rounding per quantized tier (chunks only move down, so a tier can hold
        a chunk or two beyond its count). Under ``allocation="rate-distortion"`` there are no
        shares: each tier's count is its share of the chunks now, scaled to that length."""
        cfg = self.config
        g = cfg.chunk_size
        n = -(-self.max_length // g)  # chunks of the longest row
        flushed = -(-cfg.rerank_interval // g) + 1
        rankable = torch.tensor([max(n - cfg.protected_chunks, 0)])
        counts = {VALUE: policy.tier_counts(rankable, cfg.ratios)[0].tolist()}
        counts[KEY] = policy.tier_counts(rankable, cfg.key_ratios)[0].tolist() if cfg.key_ratios else counts[VALUE]
        b = self.batch_size
        if cfg.allocation == "rate-distortion":
            # no shares to plan from: each tier keeps the share of the chunks it holds now
            seen = max(int(self.n_chunks.max()), 1)
            for component, tiers in ((KEY, self.k_tier), (VALUE, self.v_tier)):
                held = [int(((self.chunk_pos >= 0) & (tiers == t)).sum()) for t in (FP16, *QUANTIZED_TIERS)]
                counts[component] = [-(-h * n // (seen * b)) for h in held] + [n - -(-sum(held) * n // (seen * b))]
        slots = {
            c: {
                FP16: b * (counts[c][FP16] + cfg.protected_chunks + flushed),
                **{t: b * (counts[c][t] + 2) for t in QUANTIZED_TIERS},
            }
            for c in (KEY, VALUE)
        }
        return slots, min(n, n - counts[VALUE][EVICTED] + flushed)

    def _reserve(self, room: tuple[dict[str, dict[int, int]], int]) -> None:
        """Pools and tables sized to ``room`` (from :meth:`_planned_room`), or to what is in use
        where that is more (an input stores all its chunks in FP16 before re-ranking moves
        them down: the room it took is given back)."""
        slots, width = room
        for component, by_tier in slots.items():
            pools = self.pools[component]
            for t, n in by_tier.items():
                n = max(n, pools.used[t])
                if n != pools.capacity(t):
                    pools.resize(t, n)
        self._resize_table(max(width, self.live_table().chunk_pos.shape[1]))

    def _resize_table(self, width: int) -> None:
        """Chunk tables exactly ``width`` wide (new tensors): new columns empty, and only
        empty columns dropped."""
        w = self.chunk_pos.shape[1]
        if width > w:
            self._set_table(ChunkTable(*(torch.nn.functional.pad(t, (0, width - w), value=-1) for t in self.table)))
        elif width < w:
            # own storage, so the wider tables are freed (their layout for compiled steps: _mark_for_compile)
            narrow = (t[:, :width].clone() for t in self.table)
            self._set_table(ChunkTable(*narrow))

    def _widen(self, width: int) -> None:
        """Chunk tables at least ``width`` wide: a static cache grows them by
        :func:`~hqekv.pools.grown`, others to exactly ``width``."""
        w = self.chunk_pos.shape[1]
        if width > w:
            self._resize_table(max(width, grown(w)) if self.static else width)

    def _store_decode_token(self, query, key, value, new_valid) -> None:
        """Write one token per row into the tail and the query window, with fixed shapes.

        The tail has room when :meth:`maintain` ran since the last step; a row whose tail is
        full keeps its tail and is marked ``overrun`` (NaN output, an error at the next
        :meth:`maintain`).
        """
        with torch.no_grad():
            written, overrun = tail.write_one(self.tail_k, self.tail_v, self.tail_len, key, value, new_valid[:, 0])
            self.overrun |= overrun
            window.push_one(self.win_q, self.win_pos, self.win_valid, query, self.real_len, written)
            self.real_len += written
            self.since_rerank += written
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
        full = self.tail_len >= g
        with torch.no_grad():
            self._add_fp16_chunks(tail.as_chunk(self.tail_k), tail.as_chunk(self.tail_v), full[:, None])
            self.tail_len.masked_fill_(full, 0)
            due = full & (self.since_rerank >= self.config.rerank_interval)
            if bool(due.any()):
                self.rerank(due)
        self._mark_for_compile()

    def _look(self) -> list[int]:
        """The one host sync of :meth:`maintain`: each row's tail length, after checking what
        the decode steps stored and that none of them found a full tail."""
        peak = torch.maximum(self.tail_k.abs().amax(), self.tail_v.abs().amax()).float()
        *tail_len, peak, overrun = torch.cat(
            [self.tail_len.float(), peak[None], self.overrun.any().float()[None]]
        ).tolist()
        if overrun:
            rows = self.overrun.nonzero().flatten().tolist()
            raise RuntimeError(
                f"layer {self.layer_idx}: decode steps ran without HqeKVCache.maintain() between them, and the full "
                f"FP16 tail of rows {rows} could not take a token (their outputs since are NaN); call cache.maintain() "
                "before each decode step of a compiled model (generate does it)"
            )
        if not fits_float16(peak):
            check_storable(self.layer_idx, (self.tail_k, self.tail_v), (self.fp_dtype, self.meta_dtype), self.seen)
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
        keys, values, positions, valid = attention.dequantized(
            self.pools, self.live_table(), self.tail_k, self.tail_v, self.tail_len, self.n_chunks,
            self.config.chunk_size, self.value_group, self.dtype,
        )  # fmt: skip
        if new_keys is not None:
            keys, values = torch.cat([keys, new_keys], dim=2), torch.cat([values, new_values], dim=2)
        return keys, values, positions, valid

    def _append(self, query, key, value, new_valid) -> None:
        """Window, tail, flush of full chunks into FP16 slots, and re-ranking when due."""
        n_new = new_valid.sum(1)
        positions = self.real_len[:, None] + new_valid.long().cumsum(1) - 1
        self.win_q, self.win_pos, self.win_valid = window.append(
            self.win_q, self.win_pos, self.win_valid, query, positions, new_valid
        )
        chunks_k, chunks_v, chunk_ok, self.tail_k, self.tail_v, self.tail_len = tail.append(
            self.tail_k, self.tail_v, self.tail_len, key, value, new_valid
        )
        if chunk_ok.shape[1]:
            self._add_fp16_chunks(chunks_k, chunks_v, chunk_ok)
        self.real_len = self.real_len + n_new
        self.since_rerank = self.since_rerank + n_new
        due = chunk_ok.any(1) & (self.since_rerank >= self.config.rerank_interval)
        if bool(due.any()):
            self.rerank(due, provisional=True)

    def _add_fp16_chunks(self, fk: torch.Tensor, fv: torch.Tensor, ok: torch.Tensor) -> None:
        """Append new chunks (B, F, H, G, D) where ``ok`` (B, F) to the FP16 pools and chunk tables."""
        rows, cols = ok.nonzero(as_tuple=True)
        # K and V hold different numbers of FP16 slots once re-ranks have moved some chunks of one
        # component down and not the other's: each new chunk's slot is the end of its own pool.
        added = torch.arange(rows.numel(), device=self.device)
        slots = {}
        for component, new in ((KEY, fk), (VALUE, fv)):
            pools = self.pools[component]
            start = pools.used[FP16]
            slots[component] = start + added
            pools.store(FP16, start, new[rows, cols].to(self.fp_dtype), self.static)
        n_phys = (self.chunk_pos >= 0).sum(1)
        self._widen(int((n_phys + ok.sum(1)).max()))
        dest = n_phys[rows] + cols
        for table, value in zip(self.table, (self.n_chunks[rows] + cols, FP16, slots[KEY], FP16, slots[VALUE])):
            table[rows, dest] = value
        self.n_chunks += ok.sum(1)

    def chunk_importance(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Importance of every kept chunk from the window queries (SPEC §1.2).

        -> score_k, score_v (B, C) float32 chunk scores in the order of :meth:`live_table`.
        The cache is read a tile at a time (:meth:`window_tiles`). The scores do not depend
        on ``config.rotation`` (beyond rounding): q·k is invariant and range(V) is taken in
        the model's basis.
        """
        g = self.config.chunk_size
        chunk_pos = self.live_table().chunk_pos
        c = chunk_pos.shape[1]
        score_k, score_v = torch.zeros(2, *chunk_pos.shape, device=self.device)
        for start, _, values, probs, visible in self.window_tiles(tiles=self.tile_reader()):
            if start < c:
                nc = values.shape[2] // g
                score_k[:, start : start + nc], score_v[:, start : start + nc] = importance.chunk_importance_scores(
                    probs, visible, unrotate(values, self.rotation), nc, g
                )
        if self.config.importance == "random":
            score_k, score_v = importance.random_scores(chunk_pos, self.layer_idx or 0)
        return score_k, score_v

    def dequantized_tiles(self, values: bool = True, tile: int = RERANK_TILE_CHUNKS):
        """:func:`hqekv.attention.dequantized_tiles` of this layer, each tile checked:
        ``ValueError`` when it holds a NaN or an infinity (nothing can be ranked or quantized)."""
        for start, keys, vals, positions, valid in attention.dequantized_tiles(
            self.pools, self.live_table(), self.tail_k, self.tail_v, self.tail_len, self.n_chunks,
            self.config.chunk_size, self.value_group, self.dtype, values, tile,
        ):  # fmt: skip
            if not (_finite(keys) and (vals is None or _finite(vals))):
                raise ValueError(
                    f"non-finite (NaN/inf) key or value states in layer {self.layer_idx}: they cannot be ranked or "
                    "quantized"
                )
            yield start, keys, vals, positions, valid

    def tile_reader(self):
        """-> tiles(values=True): the dequantized tiles of this layer for one pass of a
        re-rank (:meth:`dequantized_tiles`). A cache of at most :data:`HELD_TILE_BYTES`
        dequantized is read once, as one tile, and every pass reuses it; a longer one is
        read again, a tile at a time, by each pass."""
        c = self.live_table().chunk_pos.shape[1]
        tokens = (c + 1) * self.config.chunk_size
        dense = 2 * self.batch_size * self.num_kv_heads * tokens * self.head_dim * self.dtype.itemsize
        if dense > HELD_TILE_BYTES:
            return self.dequantized_tiles
        held = list(self.dequantized_tiles(tile=max(c, 1)))
        return lambda values=True: iter(held)

    def window_tiles(self, lse: torch.Tensor | None = None, tiles=None):
        """The window queries' probabilities over this layer's cache, a tile at a time
        (:func:`hqekv.importance.window_tiles`): yields (start, keys, values, probs, visible);
        start is the tile's first table column, C for the tail. ``lse``: the softmax
        denominators of an earlier pass over the same cache (computed when not given);
        ``tiles``: a :meth:`tile_reader` (:meth:`dequantized_tiles` when not given)."""
        tiles = tiles or self.dequantized_tiles
        if lse is None:
            lse = self.window_lse(tiles)
        return importance.window_tiles(self.win_q, self.win_pos, self.win_valid, tiles(), self.scaling, lse)

    def window_lse(self, tiles=None) -> torch.Tensor:
        """Log of each window query's softmax denominator over this layer's cache (B, Hkv, g, m)."""
        tiles = tiles or self.dequantized_tiles
        return importance.window_lse(self.win_q, self.win_pos, self.win_valid, tiles(False), self.scaling)

    def choices(self, provisional: bool = False) -> "allocation.LayerChoices":
        """What the rate-distortion allocator chooses from (``allocation="rate-distortion"``,
        :mod:`hqekv.allocation`): the :class:`~hqekv.allocation.LayerChoices` of every chunk
        of :meth:`live_table`.

        The budget of a row is its share of ``bavg`` bits per element of all the chunks it
        has seen, evicted ones included (``provisional``: :data:`~hqekv.allocation.PROVISIONAL`
        times that); the top ``protected_chunks`` under either importance metric are never
        evicted. Three passes over the cache a tile at a time: the window's softmax
        denominators, the window outputs and importance, then the distortions.
        """
        cfg, g = self.config, self.config.chunk_size
        table = self.live_table()
        b, c = table.chunk_pos.shape
        score_k, score_v = torch.zeros(2, b, c, device=self.device)
        tiles = self.tile_reader()
        out, lse = 0.0, self.window_lse(tiles)
        for start, _, values, probs, visible in self.window_tiles(lse, tiles):
            out = out + allocation.window_outputs(probs, values)
            if start < c:
                nc = values.shape[2] // g
                score_k[:, start : start + nc], score_v[:, start : start + nc] = importance.chunk_importance_scores(
                    probs, visible, unrotate(values, self.rotation), nc, g
                )
        d_k, d_v = torch.zeros(2, b, c, 4, device=self.device)
        d_evict = torch.zeros(b, c, device=self.device)
        for start, keys, values, probs, _ in self.window_tiles(lse, tiles):
            if start < c:
                cols = slice(start, start + values.shape[2] // g)
                d_k[:, cols], d_v[:, cols], d_evict[:, cols] = allocation.tile_distortions(
                    probs, self.win_q, keys, values, out, g, self.scaling, self.value_group, self.meta_dtype,
                    allocation.ERROR_MODEL, table.k_tier[:, cols], table.v_tier[:, cols],
                )  # fmt: skip
        chunks = table.chunk_pos >= 0
        evictable = chunks
        for scores in (score_k, score_v):
            evictable = evictable & (policy.descending_rank(scores, chunks) >= cfg.protected_chunks)
        budget = self.fair_budget() * self.budget_share * (allocation.PROVISIONAL if provisional else 1.0)
        energy = out.square().sum((1, 2, 3, 4))
        return allocation.LayerChoices(d_k, d_v, d_evict, table.k_tier, table.v_tier, evictable, budget, energy)

    def fair_budget(self) -> torch.Tensor:
        """Bytes per row that ``bavg`` bits per element of every chunk the row has seen (evicted
        ones included) come to (B,) float64: this layer's part of the model's budget when the
        layers share it evenly."""
        elements = 2 * self.num_kv_heads * self.config.chunk_size * self.head_dim
        return self.n_chunks.double() * self.config.bavg / 8 * elements

    def chunk_bytes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Real bytes of one chunk's keys and of its values at each kept tier (:func:`hqekv.allocation.chunk_bytes`)."""
        fp = self.pools[KEY].fp
        return allocation.chunk_bytes(
            self.num_kv_heads, self.config.chunk_size, self.head_dim, self.value_group,
            fp.element_size(), self.pools[KEY].quantized[QUANTIZED_TIERS[0]].meta0.element_size(), fp.device,
        )  # fmt: skip

    def chunk_storage_bytes(self) -> torch.Tensor:
        """Real bytes each row's chunks hold at their tiers, codes and metadata (B,) float64:
        what the rate-distortion budget counts."""
        bytes_k, bytes_v = self.chunk_bytes()
        table = self.live_table()
        per_chunk = bytes_k[table.k_tier.clamp(0, INT1)] + bytes_v[table.v_tier.clamp(0, INT1)]
        return torch.where(table.chunk_pos >= 0, per_chunk, 0.0).sum(1)

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
        """Hold ``pools`` through ``table`` in place of the current chunks (:mod:`hqekv.rerank`).

        A static cache copies them into its own tensors (growing those that lack room), so
        every address a decode step uses stays; other caches take them as they are.
        """
        if not self.static:
            self._set_table(table)
            self.pools = pools
        else:
            for component, new in pools.items():
                own = self.pools[component]
                for t in (FP16, *QUANTIZED_TIERS):
                    own.used[t] = 0
                    own.store(t, 0, new.in_use(t), static=True)
            self._widen(table.chunk_pos.shape[1])
            for own, new in zip(self.table, table):
                own.fill_(-1)
                own[:, : new.shape[1]] = new
        self._mark_for_compile()

    def rerank(self, rows: torch.Tensor, provisional: bool = False) -> None:
        """Re-rank the chunks of ``rows`` (B,) bool and move them down the tiers (SPEC §1.4).

        Importance comes from the window queries over the current cache; chunks only move
        downward (FP16 → 4 → 2 → 1 → evicted), re-quantized from their dequantized values.
        While ``deferring`` (a prompt in pieces), no chunk is evicted, and under fixed ratios
        each chunk waits at 4 bits unless the policy keeps it in FP16 (:data:`WAITING`) for
        :meth:`HqeKVCache.settle`.
        Under ``allocation="rate-distortion"``, ``provisional`` (a multi-token input) keeps
        the layer within :data:`~hqekv.allocation.PROVISIONAL` times its budget and leaves its
        choices in ``pending`` for :meth:`HqeKVCache.share_budget`.
        """
        table = self.live_table()
        cfg = self.config
        if cfg.allocation == "rate-distortion":
            found = self.choices(provisional)
            if self.deferring:
                found.evictable = torch.zeros_like(found.evictable)
            prop_k, prop_v = allocation.allocate(
                found.d_k, found.d_v, found.d_evict, *self.chunk_bytes(), found.k_tier, found.v_tier,
                found.evictable, found.budget,
            )  # fmt: skip
        else:
            score_k, score_v = self.chunk_importance()
            prop_k, prop_v = rerank.propose(
                cfg, score_k, score_v, table, self.n_chunks, self.n_evicted, cfg.ratios, cfg.key_ratios
            )
            if self.deferring:  # nothing is evicted, and each chunk waits at 4 bits at most for the prompt's end
                prop_k, prop_v = rerank.waiting(prop_k, WAITING), rerank.waiting(prop_v, WAITING)
        here = rows[:, None] & (table.chunk_pos >= 0)
        new_k = torch.where(here, prop_k, table.k_tier)
        new_v = torch.where(here, prop_v, table.v_tier)
        self.apply_tiers(table, new_k, new_v)
        self.since_rerank.masked_fill_(rows, 0)
        if provisional and cfg.allocation == "rate-distortion":
            new_k, new_v = torch.maximum(table.k_tier, new_k), torch.maximum(table.v_tier, new_v)
            kept = (table.chunk_pos >= 0) & (new_k != EVICTED)
            self.pending = found.kept(kept, new_k, new_v)

    def apply_tiers(self, table: ChunkTable, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """Move the chunks of ``table`` (this layer's live table) to ``new_k``, ``new_v`` (B, C),
        each at its tier or below; those that move are re-quantized from their dequantized
        values, a tile of them at a time."""
        new_k = torch.maximum(table.k_tier, new_k)
        new_v = torch.maximum(table.v_tier, new_v)
        evicted = (table.chunk_pos >= 0) & (new_k == EVICTED)
        read = attention.read_chunks(self.pools, table, self.value_group, self.dtype)
        self.set_chunks(*rerank.rebuild(table, self.pools, new_k, new_v, read, self.value_group, self.meta_dtype))
        self.n_evicted += evicted.sum(1)

    # --- accounting ----------------------------------------------------------------------------

    def storage(self) -> dict[str, int]:
        """Real bytes of everything this layer stores, by part.

        The rotation matrix is not counted: one constant shared by every layer and cache.
        """
        if not self.is_initialized:
            return {}
        out = {f"{comp}.{tier}": n for comp in (KEY, VALUE) for tier, n in self.pools[comp].nbytes().items()}
        for part, names in _ROW_PARTS.items():
            out[part] = sum(getattr(self, n).nbytes for n in names)
        out["counters"] += self.length.nbytes
        # a static cache's room for chunks to come: free pool slots and empty table columns
        empty_columns = sum(t.nbytes for t in self.table) - sum(t.nbytes for t in self.live_table())
        out["tables"] -= empty_columns
        out["reserve"] = empty_columns + sum(self.pools[comp].reserve_nbytes() for comp in (KEY, VALUE))
        return out

    def chunk_counts(self) -> dict[str, int]:
        """Kept chunks per tier and component, evicted chunks and tail tokens, over all rows."""
        valid = self.chunk_pos >= 0
        out = {}
        for comp, tier in ((KEY, self.k_tier), (VALUE, self.v_tier)):
            for t in (FP16, *QUANTIZED_TIERS):
                out[f"{comp}.{TIER_NAMES[t]}"] = int((valid & (tier == t)).sum())
        out["evicted"] = int(self.n_evicted.sum())
        out["tail_tokens"] = int(self.tail_len.sum())
        out["real_tokens"] = int(self.real_len.sum())
        return out


class HqeKVCache(Cache):
    """A ``transformers`` cache with one layer per attention layer of the model.

    Global attention layers get an :class:`HqeKVLayer` (the j-th of them with
    ``config.for_layer(j)``: its own ratios under per-layer budgets); a layer whose entry in
    ``sliding_windows`` is a window W gets a :class:`~hqekv.sliding.SlidingWindowLayer` that
    keeps its last W − 1 tokens exactly (docs/architectures.md). Create one per request
    (``generate`` does it for a patched model); it holds all of that request's state.
    ``input_valid`` (B, S) bool is the padding mask of the tokens of the forward in
    progress, set by the patched model from its 2-D ``attention_mask``.

    ``max_length`` (tokens per row, prompt included) makes the cache *static*, for CUDA
    graphs: after the prefill each layer reserves the pool slots and table columns its
    ratios imply for that length, and a decode step, the flush of a full tail and a
    re-rank write in place, so every tensor a decode step uses keeps its address (storage
    that runs out of room grows by a quarter, in the eager step: then a CUDA graph
    re-records once). The reserve is real memory, reported as part ``reserve``.
    ``generate`` makes its cache static when it compiles the decode step. Without
    ``max_length`` storage is exactly what the chunks need, and changes address as the
    cache grows.
    """

    def __init__(
        self,
        config: HqeKVConfig,
        num_layers: int,
        sliding_windows: Sequence[int | None] | None = None,
        max_length: int | None = None,
    ):
        windows = [None] * num_layers if sliding_windows is None else list(sliding_windows)
        if len(windows) != num_layers:
            raise ValueError(f"{len(windows)} sliding windows given for {num_layers} layers")
        n_global = windows.count(None)
        if config.layer_ratios is not None and len(config.layer_ratios) != n_global:
            raise ValueError(
                f"layer_ratios give {len(config.layer_ratios)} per-layer budgets but this model has {n_global} "
                "compressed (global attention) layers: per-layer ratios are made for one architecture"
            )
        layers, j = [], 0
        for i, w in enumerate(windows):
            if w is None:
                layers.append(HqeKVLayer(config.for_layer(j), i, max_length))
                j += 1
            else:
                layers.append(SlidingWindowLayer(config, w, i, max_length))
        super().__init__(layers=layers)
        self.config = config
        self.max_length = max_length
        self.input_valid: torch.Tensor | None = None

    @property
    def hqekv_layers(self) -> list[HqeKVLayer]:
        """The compressed (global attention) layers."""
        return [layer for layer in self.layers if isinstance(layer, HqeKVLayer)]

    @property
    def holds_tokens(self) -> bool:
        """Whether a forward has stored tokens, which later forwards attend over."""
        return self.layers[0].has_tokens

    def length_tensor(self) -> torch.Tensor:
        """The logical length as a 0-d int64 tensor (read inside compiled graphs; see ``seen``)."""
        return self.layers[0].length

    def maintain(self) -> None:
        """The eager step between decode steps: flush full tails and re-rank where due, in
        every layer (:meth:`HqeKVLayer.maintain`).

        A patched model runs it before every eager forward and ``generate`` before every
        step, compiled or not. A loop that calls a compiled model itself must call it
        before each decode step; without it a full tail cannot take the next token, and the
        layer answers NaN for that row and raises at the next call.
        """
        self.share_budget()
        for layer in self.layers:
            layer.maintain()

    @torch.compiler.disable
    def share_budget(self) -> None:
        """Share the model's budget between the layers after a multi-token input
        (``allocation="rate-distortion"``, :func:`hqekv.allocation.share`); eager.

        Each layer re-ranked that input within twice its share and left its choices; one
        price of a byte per row then decides every layer's chunks, so bytes move to the
        layers where they lower the relative output error most, and each layer keeps the
        share it ends with for its decode re-ranks. A no-op when no layer has choices left.
        """
        layers = [layer for layer in self.hqekv_layers if layer.is_initialized and layer.pending is not None]
        if not layers:
            return
        # the model's budget is every layer's fair part, whatever shares the layers held before;
        # while a prompt arrives in pieces, twice that and no eviction (settle() ends it)
        choices = [
            dataclasses.replace(
                layer.pending,
                budget=layer.fair_budget() * (allocation.PROVISIONAL if layer.deferring else 1.0),
                evictable=layer.pending.evictable & (not layer.deferring),
            )
            for layer in layers
        ]
        if allocation.LAYER_SCALE == "off":
            tiers = [allocation.share([found], *layers[0].chunk_bytes())[0] for found in choices]
        else:
            tiers = allocation.share(choices, *layers[0].chunk_bytes())
        for layer, found, (k, v) in zip(layers, choices, tiers):
            layer.pending = None
            with torch.no_grad():
                layer.apply_tiers(layer.live_table(), k, v)  # marks the new storage for compile
            fair = layer.fair_budget()
            share = layer.chunk_storage_bytes() / fair.clamp(min=1e-30)
            layer.budget_share.copy_(torch.where(fair > 0, share, layer.budget_share))

    def defer_eviction(self) -> None:
        """A prompt will arrive in pieces (``generate(prefill_chunk_size=...)`` calls this; so
        can a loop of one's own): until :meth:`settle`, re-ranks quantize as usual but evict
        nothing, since the pieces to come (the question, at the end of a prompt) may need
        what an early piece's queries did not look at. Chunks the policy would evict wait
        at 1 bit (the allocator, ``ratios="auto"``: within twice the budget); that transient
        allowance is real memory, and the memory report counts it until :meth:`settle`.
        A no-op when :data:`DEFER_EVICTION` is False."""
        for layer in self.hqekv_layers:
            layer.deferring = DEFER_EVICTION

    @torch.compiler.disable
    def settle(self) -> None:
        """The end of a prompt that arrived in pieces: every layer re-ranks all its chunks with
        the prompt's last queries and evicts within the budget (SPEC §1.3); eager. A no-op
        unless :meth:`defer_eviction` was called."""
        layers = [layer for layer in self.hqekv_layers if layer.deferring]
        for layer in layers:
            layer.deferring = False
            if layer.is_initialized and layer.chunk_pos.numel():
                rows = (layer.chunk_pos >= 0).any(1)
                if bool(rows.any()):
                    with torch.no_grad():
                        layer.rerank(rows, provisional=True)
        self.share_budget()

    def advance(self, n_new: int) -> None:
        """Count ``n_new`` more tokens in the logical length of every layer, after a forward (traceable)."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.advance(n_new)

    def memory_report(self):
        """Real bytes per tier and part, against FP16 and dense caches: a :class:`~hqekv.memory.MemoryReport`
        (:func:`hqekv.memory.cache_report`)."""
        return cache_report(self.layers, self.config.bavg, self.config.chunk_size)

"""The cache of a whole model: :class:`HqeKVCache`, one layer per attention layer, and what
concerns all its layers at once: the eager step between decode steps (maintenance), the
budget shared between layers, and a prompt that arrives in pieces."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

from .. import allocation
from ..config import DEFERRING, HqeKVConfig
from ..memory import cache_report
from . import budget, rerank
from .layer import HqeKVLayer
from .sliding import SlidingWindowLayer

class HqeKVCache(Cache):
    """A ``transformers`` cache with one layer per attention layer of the model.

    Global attention layers get an :class:`HqeKVLayer` (the j-th of them with
    ``config.for_layer(j)``: its own ratios under per-layer budgets); a layer whose entry in
    ``sliding_windows`` is a window W gets a :class:`~hqekv.cache.sliding.SlidingWindowLayer` that
    keeps its last W − 1 tokens exactly (docs/architectures.md). Create one per request
    (``generate`` does it for a patched model); it holds all of that request's state.

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
        if config.layer_bits is not None and len(config.layer_bits) != n_global:
            raise ValueError(
                f"layer_bits give {len(config.layer_bits)} per-layer budgets but this model has {n_global} "
                "compressed (global attention) layers: per-layer budgets are made for one architecture"
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
        # while a prompt arrives in pieces (DEFERRED_WAIT "budget"), allocation.DEFERRED times
        # that and no eviction (settle() ends it)
        choices = [
            dataclasses.replace(
                layer.pending,
                budget=budget.fair_budget(layer) * (allocation.DEFERRED if layer.deferring else 1.0),
                evictable=layer.pending.evictable & (not layer.deferring),
            )
            for layer in layers
        ]
        rows = [found.joined(layer.split) for layer, found in zip(layers, choices)]  # a row's heads: one budget
        if allocation.LAYER_SCALE == "off" or self.config.layer_bits is not None:  # each layer its own budget
            tiers = [allocation.share([found], *budget.chunk_bytes(layers[0]))[0] for found in rows]
        else:
            tiers = allocation.share(rows, *budget.chunk_bytes(layers[0]))
        tiers = [tuple(allocation.split_rows(x, layer.split) for x in kv) for layer, kv in zip(layers, tiers)]
        for layer, (k, v) in zip(layers, tiers):
            layer.pending = None
            with torch.no_grad():
                rerank.apply_tiers(layer, layer.live_table(), k, v)  # marks the new storage for compile
            fair = budget.fair_budget(layer)
            share = budget.held_bytes(layer) / fair.clamp(min=1e-30)
            budget_share = layer.counters.budget_share
            budget_share.copy_(torch.where(fair > 0, share, budget_share))

    def defer_eviction(self) -> None:
        """A prompt will arrive in pieces (``generate(prefill_chunk_size=...)`` calls this; so
        can a loop of one's own): until :meth:`settle`, re-ranks quantize as usual but evict
        nothing, since the pieces to come (the question, at the end of a prompt) may need
        what an early piece's queries did not look at. Every chunk waits at the 4-bit tier, its
        keys stored at 8 bits (:data:`hqekv.cache.rerank.WAITING_BITS`), but those the policy
        keeps in FP16 (fixed ratios) or protects (the allocator, ``ratios="auto"``;
        :data:`~hqekv.allocation.DEFERRED_WAIT`) and those among the prompt's newest tokens
        (:data:`hqekv.cache.rerank.WAITING_RECENT`), in FP16; that transient allowance is real
        memory, and the memory report counts it until :meth:`settle` (``chunked_prefill="wait-4bit"``:
        the keys at 4 bits too).
        A no-op under ``chunked_prefill="evict"`` (:class:`~hqekv.HqeKVConfig`): every piece
        then evicts at its own re-rank, within the budget."""
        for layer in self.hqekv_layers:
            layer.deferring = layer.config.chunked_prefill in DEFERRING

    @torch.compiler.disable
    def settle(self) -> None:
        """The end of a prompt that arrived in pieces: every layer re-ranks all its chunks with
        the prompt's last queries and evicts within the budget (SPEC §1.3); eager. A no-op
        unless :meth:`defer_eviction` was called."""
        layers = [layer for layer in self.hqekv_layers if layer.deferring]
        for layer in layers:
            layer.deferring = False
            if layer.is_initialized and layer.table.chunk_pos.numel():
                rows = layer.table.kept().any(1)
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

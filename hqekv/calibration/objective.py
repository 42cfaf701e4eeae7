"""What a calibration trial scores: the next-token distributions of the compressed and the
FP16 model on a held continuation after a long calibration context (SPEC §1.5).

It is fast by design: the context is prefilled once in full precision, its K/V, chunk
importance and the dequantized value of every chunk at every tier are kept, and a trial
only assigns tiers and runs the continuation through a cache holding those values
(:class:`CompressionObjective`, built from the cache's parts' public operations:
:func:`hqekv.cache.rerank.place` and :meth:`HqeKVLayer.set_chunks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from typing import Sequence

import torch

from ..cache import HqeKVCache, HqeKVLayer, SlidingWindowLayer, rerank
from ..cache.pools import KEY, VALUE, QuantizedPool, encode_chunks
from ..allocation import KL_FLOOR
from ..config import CACHE_SETTINGS, FP16_RATIOS, HqeKVConfig, TierRatios, budget_config
from ..tiers import FP16, QUANTIZED_TIERS


ALPHA = 2.0


BETA = 4.0


KL_SCALES = ("log", "linear")
"""Data term of the search: ln(mean KL) (default: the regulariser is a tie-breaker, see
:func:`data_term`) or the mean KL itself (the paper's scale)."""


CALIBRATION_TOKENS = 16384
"""Calibration text in all, split into segments (the paper's 16K tokens)."""
CONTEXT_TOKENS = 16384
"""Context of one calibration segment when there is one (the paper's 16K tokens)."""


CONTINUATION_TOKENS = 128


def mean_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> float:
    """Mean over positions of KL(p ‖ q); log_p, log_q (L, V) float32 log-probabilities."""
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def data_term(kl: float, kl_scale: str = "log") -> float:
    """The data term of the search objective for a mean KL (SPEC §1.5 fix: scale).

    ``"log"``: ln(max(KL, KL_FLOOR)). The mean KL of a short continuation is a few
    hundredths, and it spans orders of magnitude across bavg, models and texts, so no fixed
    α, β can weigh it linearly: α·δ3 + β·δ4 of 0.1 outweighs a tenfold KL gain at one bavg
    and is noise at another. On the log scale a difference is a *ratio* of KLs, the same
    everywhere: β·δ4 says that evicting a share δ4 must divide the KL by e^(β·δ4)
    (10% of the chunks: by 1.5 with β = 4). That keeps the regulariser a tie-breaker
    between ratios of similar KL and a guard against degenerate all-evict / all-1-bit
    solutions, which must beat the alternative by e^2 to e^4. ``"linear"``: the KL itself,
    the paper's weighting of the regulariser.
    """
    if kl_scale == "log":
        return math.log(max(kl, KL_FLOOR))
    if kl_scale == "linear":
        return kl
    raise ValueError(f"kl_scale must be one of {KL_SCALES}, got {kl_scale!r}")


def _settings_config(ratios: TierRatios, settings: dict) -> HqeKVConfig:
    return HqeKVConfig(ratios=ratios, bavg=ratios.bavg, **settings)


@contextlib.contextmanager
def _patched(model, settings: dict):
    from ..patching import patch_model, unpatch_model

    patch_model(model, ratios=FP16_RATIOS, **settings)
    try:
        yield
    finally:
        unpatch_model(model)


class CompressionObjective:
    """Scores tier ratios on one calibration context and continuation (SPEC §1.5).

    Built once: the FP16 prefill of ``context`` (1, N), each layer's chunk scores and each
    chunk encoded at every quantized tier. :meth:`kl` then assigns tiers, picks each chunk's
    codes into per-tier pools (what a compressed prefill stores, bit for bit) and runs one
    forward of ``continuation`` (1, L) over them. The reference distributions come from the
    same forward over the uncompressed context, so all-FP16 ratios score exactly 0.

    Memory: the context's K/V in the model dtype plus their codes at 4, 2 and 1 bit (under
    half as much again), e.g. ~1 GB for SmolLM2-135M at 16K tokens in fp32.

    Parameters
    ----------
    model : an unpatched Hugging Face causal LM of a supported architecture
    context, continuation : (1, N), (1, L) int64 token ids
    settings : HqeKVConfig fields other than the ratios (see ``CACHE_SETTINGS``)
    """

    def __init__(self, model, context: torch.Tensor, continuation: torch.Tensor, **settings):
        from ..patching import is_patched
        from ..resolve import default_value_group, head_dim_of
        from ..transformers_internals import cache_for

        unknown = set(settings) - set(CACHE_SETTINGS)
        if unknown:
            raise TypeError(f"unknown cache settings {sorted(unknown)}; expected some of {CACHE_SETTINGS}")
        if is_patched(model):
            raise ValueError("calibrate an unpatched model: call hqekv.unpatch_model(model) first")
        if context.dim() != 2 or context.shape[0] != 1 or continuation.dim() != 2 or continuation.shape[0] != 1:
            raise ValueError("context and continuation must be (1, N) token ids: calibration runs one sequence")
        self.settings = dict(settings)
        if self.settings.get("value_group") is None:  # as patch_model resolves it
            self.settings["value_group"] = default_value_group(head_dim_of(model))
        self.config = _settings_config(FP16_RATIOS, self.settings)
        g = self.config.chunk_size
        if context.shape[1] < 2 * g:
            raise ValueError(f"the calibration context needs at least {2 * g} tokens, got {context.shape[1]}")
        self.model = model
        device = next(model.parameters()).device
        self.context = context.to(device)
        self.continuation = continuation.to(device)
        # Scoring never re-ranks: the compressed state is the one right after the prefill.
        self._trial_config = dataclasses.replace(self.config, rerank_interval=g * 2**40)

        start = time.perf_counter()
        with _patched(model, self.settings), torch.no_grad():
            cache = cache_for(self.config, model)
            model(self.context, cache=cache, use_cache=True, logits_to_keep=1)
        self.base = cache
        if not cache.hqekv_layers:
            raise ValueError("every attention layer of this model slides over a window: hqekv compresses none, "
                             "so there are no ratios to calibrate")  # fmt: skip
        self.scores = []  # per HqeKV layer: score_k, score_v (1, C)
        self.encoded = []  # per HqeKV layer: keys, values {tier: every chunk at that tier}
        for layer in cache.hqekv_layers:  # sliding-window layers stay exact (hqekv.cache.sliding)
            score_k, score_v = rerank.chunk_scores(layer)
            keys, values, _, _ = layer.physical_cache()
            c = layer.table.width
            if not bool((layer.table.k_tier == 0).all()) or c * g > keys.shape[2]:
                raise AssertionError("the FP16 prefill must hold every chunk in FP16")
            per_component = []
            for component, dense in ((KEY, keys), (VALUE, values)):
                chunks = dense[0, :, : c * g].reshape(layer.num_kv_heads, c, g, layer.head_dim).transpose(0, 1)
                encoded = {0: chunks.contiguous()}
                for t in QUANTIZED_TIERS:
                    encoded[t] = encode_chunks(chunks, t, component, layer.value_group, layer.meta_dtype)
                per_component.append(encoded)
            self.scores.append((score_k, score_v))
            self.encoded.append(tuple(per_component))
        self.setup_seconds = time.perf_counter() - start
        start = time.perf_counter()
        self.reference = self._log_probs(FP16_RATIOS)
        self.trial_seconds = time.perf_counter() - start  # scoring the reference costs what a trial does

    @property
    def n_chunks(self) -> int:
        return self.base.hqekv_layers[0].table.width

    @property
    def n_layers(self) -> int:
        """Compressed (global attention) layers."""
        return len(self.base.hqekv_layers)

    def tiers(
        self, ratios: TierRatios, key_ratios: TierRatios | None = None, layer_ratios: Sequence[TierRatios] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K and V tier (1, C) of each chunk of each layer right after the prefill, under
        ``ratios`` (and the keys under ``key_ratios`` when given), or each layer under its
        entry of ``layer_ratios``."""
        if layer_ratios is not None and len(layer_ratios) != self.n_layers:
            raise ValueError(f"{len(layer_ratios)} layer ratios for {self.n_layers} compressed layers")
        out = []
        for i, (layer, (score_k, score_v)) in enumerate(zip(self.base.hqekv_layers, self.scores)):
            if layer_ratios is not None:
                ratios = TierRatios.coerce(layer_ratios[i])
            out.append(
                rerank.propose(
                    self.config, score_k, score_v, layer.table, layer.counters.n_chunks, layer.counters.n_evicted, ratios,
                    key_ratios,
                )
            )
        return out

    def compressed_cache(self, ratios: TierRatios, key_ratios: TierRatios | None = None, layer_ratios=None) -> HqeKVCache:
        """A cache holding the context as ``ratios`` (``key_ratios``, ``layer_ratios``) would
        compress it: the chunks' codes, per tier."""
        ratios = TierRatios.coerce(ratios)
        key_ratios = None if key_ratios is None else TierRatios.coerce(key_ratios)
        windows = [getattr(layer, "window", None) for layer in self.base.layers]
        cache = HqeKVCache(self._trial_config, len(windows), windows)
        trial = iter(zip(self.base.hqekv_layers, self.tiers(ratios, key_ratios, layer_ratios), self.encoded))
        for i, base in enumerate(self.base.layers):
            if isinstance(base, SlidingWindowLayer):
                cache.layers[i] = base.copy()  # the continuation's forward slides it in place
            else:
                layer, (k_tier, v_tier), (k_encoded, v_encoded) = next(trial)
                encoded = {KEY: k_encoded, VALUE: v_encoded}
                cache.layers[i] = trial_layer(layer, self._trial_config, k_tier, v_tier, encoded)
        return cache

    def _log_probs(self, ratios: TierRatios, key_ratios: TierRatios | None = None, layer_ratios=None) -> torch.Tensor:
        return self._forward(self.compressed_cache(ratios, key_ratios, layer_ratios))

    def _forward(self, cache: HqeKVCache) -> torch.Tensor:
        """Log-probabilities (L, V) of the continuation over ``cache``."""
        with _patched(self.model, self.settings), torch.no_grad():
            logits = self.model(self.continuation, cache=cache, use_cache=True).logits
        return torch.log_softmax(logits[0].float(), dim=-1)

    def _kl_of(self, log_probs: torch.Tensor) -> float:
        kl = mean_kl(self.reference, log_probs)
        if not math.isfinite(kl):
            raise FloatingPointError("the compressed model produced non-finite logits on the calibration text")
        return kl

    def allocator_layers(self, bits: float) -> list[HqeKVLayer]:
        """Each compressed layer as the rate-distortion allocator (``ratios="auto"``) leaves it
        right after a prefill of the context with ``bits`` real bits per element for that
        layer alone (``layer_bits``: no budget moves between layers), ready to score
        (:meth:`layer_kls`).

        One compressed prefill serves every layer: the prefill attends over exact K/V, so
        each layer's input, and with it the chunks it keeps, is the one it gets when it is
        the only compressed layer.
        """
        from ..transformers_internals import cache_for

        config = budget_config(bits, layer_bits=[float(bits)] * self.n_layers, **self.settings)
        with _patched(self.model, self.settings), torch.no_grad():
            cache = cache_for(config, self.model)
            self.model(self.context, cache=cache, use_cache=True, logits_to_keep=1)
            cache.share_budget()  # each layer settles its choices within its own budget
        for layer in cache.hqekv_layers:
            layer.config = self._trial_config  # scoring never re-ranks, as for a trial's layers
        return cache.hqekv_layers

    def layer_kls(self, layers: Sequence[HqeKVLayer]) -> list[float]:
        """For each compressed layer j, the mean KL when ``layers[j]`` holds that layer and
        every other layer is FP16 (one continuation forward per layer)."""
        if len(layers) != self.n_layers:
            raise ValueError(f"{len(layers)} layers for {self.n_layers} compressed layers")
        slots = [i for i, layer in enumerate(self.base.layers) if isinstance(layer, HqeKVLayer)]
        out = []
        for slot, layer in zip(slots, layers):
            cache = self.compressed_cache(FP16_RATIOS)
            cache.layers[slot] = layer.copy()  # the continuation's forward appends to it
            out.append(self._kl_of(self._forward(cache)))
        return out

    def kl(self, ratios: TierRatios | Sequence[float] | dict, key_ratios=None, layer_ratios=None) -> float:
        """Mean KL(FP16 ‖ compressed) of the next-token distributions at the same positions.

        ``key_ratios``: the keys' own tier shares (``ratios`` are then the values').
        ``layer_ratios``: one set of shares per compressed layer instead of ``ratios``.

        fix: both distributions are taken at the same continuation positions (the reference
        code compares position t with t+1).
        """
        return self._kl_of(self._log_probs(TierRatios.coerce(ratios), key_ratios, layer_ratios))

    def loss(self, ratios, alpha: float = ALPHA, beta: float = BETA, kl_scale: str = "log") -> float:
        """Objective: data term of the KL (:func:`data_term`) + α·δ3 + β·δ4 (SPEC §1.5)."""
        ratios = TierRatios.coerce(ratios)
        return data_term(self.kl(ratios), kl_scale) + alpha * ratios.int1 + beta * ratios.evict


def trial_layer(
    base: HqeKVLayer,
    config: HqeKVConfig,
    k_tier: torch.Tensor,
    v_tier: torch.Tensor,
    encoded: dict[str, dict[int, torch.Tensor | QuantizedPool]],
) -> HqeKVLayer:
    """A copy of ``base``, a one-row layer right after an FP16 prefill, with its chunks put in
    the tiers ``k_tier``/``v_tier`` (1, C) give them, as a re-rank would (SPEC §1.5).

    ``encoded[component][tier]`` holds every chunk at every tier, encoded once from the
    FP16 values (:func:`hqekv.cache.rerank.place`). Tail, window and lengths are copied; ``base``
    is left unchanged.
    """
    if not base.is_initialized or base.batch_size != 1:
        raise ValueError("a trial layer needs a one-row layer that has seen tokens")
    if not bool((base.table.k_tier[base.table.kept()] == FP16).all()):
        raise ValueError("a trial layer re-tiers FP16 chunks only (the state right after an FP16 prefill)")
    layer = base.copy(chunks=False)
    layer.config = config
    table, pools, dropped = rerank.place(base.table.chunk_pos, k_tier, v_tier, encoded, base.fp_dtype)
    layer.set_chunks(table, pools)
    layer.counters.n_evicted = layer.counters.n_evicted + dropped
    return layer


def context_length(model, context_tokens: int | None, continuation_tokens: int, segments: int = 1) -> int:
    """Context tokens per calibration segment: ``context_tokens``, or by default
    ``CALIBRATION_TOKENS / segments - continuation_tokens`` capped to the model's context.

    Raises ``ValueError`` when an explicit length with the continuation exceeds the model's
    ``max_position_embeddings``.
    """
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if context_tokens is None:
        context_tokens = CALIBRATION_TOKENS // segments - continuation_tokens
        if limit is not None:
            context_tokens = min(context_tokens, limit - continuation_tokens)
    elif limit is not None and context_tokens + continuation_tokens > limit:
        raise ValueError(
            f"{context_tokens} context + {continuation_tokens} continuation tokens exceed the model's "
            f"max_position_embeddings ({limit}): its distributions past that are not a calibration signal"
        )
    return context_tokens


class SegmentedObjective:
    """One :class:`CompressionObjective` per calibration segment (context, continuation).

    A 128-token continuation after one context is a noisy signal: a handful of chunks it
    happens to need can decide its KL. Several segments of the text average that out; the
    search scores the mean data term over them (:func:`run_study`).

    contexts (S, N), continuations (S, L) int64; settings as for :class:`CompressionObjective`.
    """

    def __init__(self, model, contexts: torch.Tensor, continuations: torch.Tensor, **settings):
        if contexts.dim() != 2 or continuations.dim() != 2 or contexts.shape[0] != continuations.shape[0]:
            raise ValueError("contexts and continuations must be (S, N) and (S, L) token ids, one row per segment")
        self.parts = [CompressionObjective(model, c[None], n[None], **settings) for c, n in zip(contexts, continuations)]
        self.settings, self.config = self.parts[0].settings, self.parts[0].config
        self.setup_seconds = sum(p.setup_seconds for p in self.parts)
        self.trial_seconds = sum(p.trial_seconds for p in self.parts)

    @property
    def n_layers(self) -> int:
        return self.parts[0].n_layers

    def kls(self, ratios, key_ratios=None, layer_ratios=None) -> list[float]:
        """Mean KL of each segment's continuation."""
        return [part.kl(ratios, key_ratios, layer_ratios) for part in self.parts]

    def kl(self, ratios, key_ratios=None, layer_ratios=None) -> float:
        """Mean KL over the segments."""
        return statistics.fmean(self.kls(ratios, key_ratios, layer_ratios))


def segment_kls(objective, ratios, key_ratios=None, layer_ratios=None) -> list[float]:
    """One KL per calibration segment: of a :class:`SegmentedObjective`, or the one of a
    :class:`CompressionObjective`."""
    extra = {} if layer_ratios is None else {"layer_ratios": layer_ratios}
    if hasattr(objective, "kls"):
        return objective.kls(ratios, key_ratios, **extra)
    return [objective.kl(ratios, key_ratios, **extra)]


def reference_style_kl(model, context: torch.Tensor, continuation: torch.Tensor, ratios, **settings) -> float:
    """The objective as a reference run computes it: a full compressed prefill per trial.

    Used to check :class:`CompressionObjective` and to time what it saves. Reference
    distributions come from an FP16 run of the same shape.
    """
    from ..patching import patch_model, unpatch_model
    from ..transformers_internals import cache_for

    def log_probs(r):
        patch_model(model, ratios=r, **settings)
        try:
            with torch.no_grad():
                cache = cache_for(_settings_config(TierRatios.coerce(r), settings), model)
                model(context, cache=cache, use_cache=True, logits_to_keep=1)
                logits = model(continuation, cache=cache, use_cache=True).logits
        finally:
            unpatch_model(model)
        return torch.log_softmax(logits[0].float(), dim=-1)

    return mean_kl(log_probs(FP16_RATIOS), log_probs(ratios))

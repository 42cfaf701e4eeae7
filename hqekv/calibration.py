"""Offline search of the tier ratios: Optuna TPE over (δ3, δ4) (paper Algorithm 1, SPEC §1.5).

The objective compares the next-token distributions of the compressed and the FP16 model
on a held continuation after a long calibration context. It is fast by design: the
context is prefilled once in full precision, its K/V, chunk importance and the dequantized
value of every chunk at every tier are kept, and a trial only assigns tiers and runs the
continuation through a cache holding those values (:class:`CompressionObjective`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from . import rerank
from .cache import HqeKVCache, HqeKVLayer
from .config import CACHE_SETTINGS, FP16_RATIOS, HqeKVConfig, TierRatios, check_bavg
from .pools import KEY, VALUE, QuantizedPool, encode_chunks
from .sliding import SlidingWindowLayer
from .tiers import FP16, QUANTIZED_TIERS

ALPHA = 2.0
BETA = 4.0
KL_SCALES = ("log", "linear")
"""Data term of the search: ln(mean KL) (default: the regulariser is a tie-breaker, see
:func:`data_term`) or the mean KL itself (the paper's scale)."""
KL_FLOOR = 1e-9
"""ln(KL) is taken of max(KL, KL_FLOOR): all-FP16 ratios score exactly 0 KL."""
DEFAULT_TRIALS = 200
CONTEXT_TOKENS = 16384
"""Context of one calibration segment when there is one (the paper's 16K tokens)."""
CALIBRATION_TOKENS = 16384
"""Calibration text in all, split into segments (the paper's 16K tokens)."""
DEFAULT_SEGMENTS = 4
CONTINUATION_TOKENS = 128
SEARCH_ROTATION = None
"""The basis :func:`calibrate` searches in unless told: unrotated (``docs/calibration.md`` §4)."""


def ratios_from_free(bavg: float, x3: float, x4: float) -> TierRatios | None:
    """δ1, δ2 in closed form from x3 = δ3, x4 = δ4 (SPEC §1.5); None when infeasible.

    δ1 = (bavg − 2 + x3 + 2·x4) / 2, δ2 = (4 − bavg − 3·x3 − 4·x4) / 2, so that
    4δ1 + 2δ2 + δ3 = bavg and δ1 + δ2 + δ3 + δ4 = 1.
    """
    d1 = (bavg - 2 + x3 + 2 * x4) / 2
    d2 = (4 - bavg - 3 * x3 - 4 * x4) / 2
    if d1 < 0 or d2 < 0 or x3 < 0 or x4 < 0:
        return None
    return TierRatios(int4=d1, int2=d2, int1=x3, evict=x4)


def one_bit_range(bavg: float, x4: float) -> tuple[float, float] | None:
    """The 1-bit shares x3 for which budget ``bavg`` with evicted share ``x4`` is feasible
    (δ1 ≥ 0 and δ2 ≥ 0 in :func:`ratios_from_free`), as (lowest, highest); None if none is."""
    lo = max(0.0, 2 - bavg - 2 * x4)
    hi = (4 - bavg - 4 * x4) / 3
    return (lo, hi) if hi >= lo else None


def split_ratios_from_free(
    bavg: float, shift: float, u3k: float, u3v: float, x4: float
) -> tuple[TierRatios, TierRatios] | None:
    """(key ratios, value ratios) for budgets bavg + shift (keys) and bavg − shift (values).

    The evicted share x4 is shared (one evicted set); each component's 1-bit share is the
    fraction ``u3k`` / ``u3v`` in [0, 1] of its feasible range (:func:`one_bit_range`), and
    its δ1, δ2 follow as in :func:`ratios_from_free`. None when x4 is infeasible for either
    budget. The mean code bits per element is bavg whatever the shift.
    """
    out = []
    for budget, u in ((bavg + shift, u3k), (bavg - shift, u3v)):
        span = one_bit_range(budget, x4)
        if span is None:
            return None
        ratios = ratios_from_free(budget, span[0] + u * (span[1] - span[0]), x4)
        if ratios is None:  # a rounding error at the edge of the range
            return None
        out.append(ratios)
    return out[0], out[1]


def shift_box(bavg: float) -> float:
    """Largest |shift| of the key/value budget split for which some evicted share is feasible
    for both budgets: |shift| ≤ 0.6·bavg and ≤ 4 − bavg."""
    return min(0.6 * bavg, 4 - bavg)


def search_box(bavg: float) -> tuple[float, float]:
    """Upper bounds of x3 and x4: beyond them δ2 < 0 whatever the other variable."""
    bavg = check_bavg(bavg)
    if not 0 < bavg < 4:
        raise ValueError(
            f"the ratio search covers 0 < bavg < 4 (SPEC eq. 6 with no FP16 share); got {bavg:g}. "
            "Above 4 bits use hqekv.uncalibrated_ratios(bavg) (FP16 + 4-bit) or explicit ratios."
        )
    return min(1.0, (4 - bavg) / 3), min(1.0, (4 - bavg) / 4)


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
    from .patching import patch_model, unpatch_model

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
        from .patching import cache_for, default_value_group, head_dim_of, is_patched

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
        for layer in cache.hqekv_layers:  # sliding-window layers stay exact (hqekv.sliding)
            score_k, score_v = layer.chunk_importance()
            keys, values, _, _ = layer.physical_cache()
            c = layer.chunk_pos.shape[1]
            if not bool((layer.k_tier == 0).all()) or c * g > keys.shape[2]:
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
        return self.base.hqekv_layers[0].chunk_pos.shape[1]

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
                    self.config, score_k, score_v, layer.table, layer.n_chunks, layer.n_evicted, ratios, key_ratios
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
        cache = self.compressed_cache(ratios, key_ratios, layer_ratios)
        with _patched(self.model, self.settings), torch.no_grad():
            logits = self.model(self.continuation, cache=cache, use_cache=True).logits
        return torch.log_softmax(logits[0].float(), dim=-1)

    def kl(self, ratios: TierRatios | Sequence[float] | dict, key_ratios=None, layer_ratios=None) -> float:
        """Mean KL(FP16 ‖ compressed) of the next-token distributions at the same positions.

        ``key_ratios``: the keys' own tier shares (``ratios`` are then the values').
        ``layer_ratios``: one set of shares per compressed layer instead of ``ratios``.

        fix: both distributions are taken at the same continuation positions (the reference
        code compares position t with t+1).
        """
        kl = mean_kl(self.reference, self._log_probs(TierRatios.coerce(ratios), key_ratios, layer_ratios))
        if not math.isfinite(kl):
            raise FloatingPointError("the compressed model produced non-finite logits on the calibration text")
        return kl

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
    FP16 values (:func:`hqekv.rerank.place`). Tail, window and lengths are copied; ``base``
    is left unchanged.
    """
    if not base.is_initialized or base.batch_size != 1:
        raise ValueError("a trial layer needs a one-row layer that has seen tokens")
    if not bool((base.k_tier[base.chunk_pos >= 0] == FP16).all()):
        raise ValueError("a trial layer re-tiers FP16 chunks only (the state right after an FP16 prefill)")
    layer = base.copy(chunks=False)
    layer.config = config
    table, pools, dropped = rerank.place(base.chunk_pos, k_tier, v_tier, encoded, base.fp_dtype)
    layer.set_chunks(table, pools)
    layer.n_evicted = layer.n_evicted + dropped
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


LAYER_STRENGTHS = (0.25, 0.5, 0.75, 1.0, 1.5)
"""Strengths γ of the per-layer split that :func:`layer_budgets` tries (γ = 0, one set of
ratios for all layers, is always a candidate)."""


def ratios_at(base: TierRatios, bits: float) -> TierRatios:
    """Tier shares of budget ``bits`` on a path through ``base`` (per-layer budgets).

    Below ``base.bavg`` every kept tier shrinks by the same factor and the rest is evicted
    (a layer that needs less keeps fewer chunks, as in PyramidKV); above it the shares move
    linearly towards all 4-bit (4 bits), then towards all FP16 (16 bits). Code bits are
    linear along the path, so the result has exactly ``bits``.
    """
    bits = check_bavg(bits)
    b = base.bavg
    values = base.as_tuple()
    if abs(bits - b) < 1e-12:
        return base
    if bits < b:
        t = bits / b
        kept = [v * t for v in values[:4]]
        return TierRatios(*kept, 1 - sum(kept))
    start, b0 = values, b
    if b < 4:
        if bits <= 4:
            return _towards(values, (0.0, 1.0, 0.0, 0.0, 0.0), (bits - b) / (4 - b))
        start, b0 = (0.0, 1.0, 0.0, 0.0, 0.0), 4.0
    return _towards(start, (1.0, 0.0, 0.0, 0.0, 0.0), (bits - b0) / (16 - b0))


def _towards(start, end, t: float) -> TierRatios:
    mixed = [max(0.0, a + t * (e - a)) for a, e in zip(start, end)]
    total = sum(mixed)
    return TierRatios(*(v / total for v in mixed))


def split_budget(bavg: float, sensitivity: Sequence[float], strength: float) -> list[float]:
    """Per-layer budgets averaging ``bavg``: b_l = c + γ·½·log2(s_l / geomean(s)), clipped
    to [bavg/4, min(16, 3·bavg)], with c set so that the mean is ``bavg``.

    γ = 1 is the classic reverse water-filling of bits: if a layer's loss is s_l·4^(−b_l)
    (each bit quarters the quantization noise power), that split minimises the sum. The
    tiers' real curves differ (eviction is not quantization), so γ is searched.
    """
    bavg = check_bavg(bavg)
    if strength < 0 or not math.isfinite(strength):
        raise ValueError(f"strength must be a finite number >= 0, got {strength!r}")
    logs = [math.log2(max(s, KL_FLOOR)) for s in sensitivity]
    mean_log = statistics.fmean(logs)
    d = [strength * 0.5 * (x - mean_log) for x in logs]
    lo, hi = bavg / 4, min(16.0, 3 * bavg)

    def budgets(c):
        return [min(hi, max(lo, c + x)) for x in d]

    a, z = lo - max(d), hi - min(d)  # the mean is lo at a and hi at z, monotone between
    for _ in range(100):
        c = (a + z) / 2
        a, z = (c, z) if statistics.fmean(budgets(c)) < bavg else (a, c)
    return budgets((a + z) / 2)


@dataclass
class LayerBudgets:
    """What :func:`layer_budgets` found: per-layer ratios (None when one set for all won)."""

    strength: float
    layer_ratios: tuple[TierRatios, ...] | None
    sensitivity: list[float]
    search: list[dict]  # strength, bits (per layer), kl, kls, loss
    seconds: float

    def metadata(self) -> dict:
        return {
            "layer_strength": self.strength,
            "layer_sensitivity": self.sensitivity,
            "layer_search": [{k: v for k, v in row.items() if k != "kls"} for row in self.search],
            "layer_seconds": round(self.seconds, 3),
        }


def layer_sensitivity(objective, ratios: TierRatios) -> list[float]:
    """Mean KL with compressed layer l alone at ``ratios`` and every other layer FP16, per layer."""
    n = objective.n_layers
    out = []
    for i in range(n):
        layers = [FP16_RATIOS] * n
        layers[i] = ratios
        out.append(objective.kl(ratios, layer_ratios=layers))
    return out


def layer_budgets(
    objective,
    ratios: TierRatios,
    *,
    strengths: Sequence[float] = LAYER_STRENGTHS,
    alpha: float = ALPHA,
    beta: float = BETA,
    kl_scale: str = "log",
) -> LayerBudgets:
    """Split the budget of ``ratios`` over the layers (issue: per-layer budgets).

    1. Sensitivity: the KL with each compressed layer alone at ``ratios`` (one trial's cost
       per layer, :func:`layer_sensitivity`).
    2. For each strength γ in ``strengths``, budgets :func:`split_budget` and each layer's
       shares :func:`ratios_at` on the path through ``ratios``; scored like a trial (mean
       data term + α·δ3 + β·δ4, the shares averaged over layers), against γ = 0 (``ratios``
       in every layer). The lowest loss wins.
    """
    ratios = TierRatios.coerce(ratios)
    start = time.perf_counter()
    sensitivity = layer_sensitivity(objective, ratios)
    bavg = ratios.bavg
    search, best = [], None
    for strength in (0.0, *strengths):
        if strength == 0:
            layers = None
            kls = segment_kls(objective, ratios)
            x3, x4 = ratios.int1, ratios.evict
            bits = [bavg] * objective.n_layers
        else:
            bits = split_budget(bavg, sensitivity, strength)
            layers = tuple(ratios_at(ratios, b) for b in bits)
            kls = segment_kls(objective, ratios, layer_ratios=layers)
            x3 = statistics.fmean(r.int1 for r in layers)
            x4 = statistics.fmean(r.evict for r in layers)
        loss = statistics.fmean(data_term(kl, kl_scale) for kl in kls) + alpha * x3 + beta * x4
        row = {"strength": strength, "bits": bits, "kl": statistics.fmean(kls), "kls": kls, "loss": loss}
        search.append(row)
        if best is None or loss < best[0]["loss"]:
            best = (row, layers)
    row, layers = best
    return LayerBudgets(row["strength"], layers, sensitivity, search, time.perf_counter() - start)


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
    from .patching import cache_for, patch_model, unpatch_model

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


@dataclass
class CalibrationResult:
    """Best ratios of one study, its history and what the artifact records."""

    bavg: float
    ratios: TierRatios
    best_loss: float
    best_kl: float
    trials: int
    history: list[dict] = field(default_factory=list)  # number, params, loss, kl, kls (per segment), state, seconds
    metadata: dict = field(default_factory=dict)
    path: Path | None = None
    key_ratios: TierRatios | None = None  # the keys' own shares (asymmetric search); ``ratios`` are the values'
    layer_ratios: tuple[TierRatios, ...] | None = None  # per-layer budgets split from ``ratios`` (per_layer)

    def report(self) -> dict:
        return {
            "bavg": self.bavg,
            "ratios": dict(zip(TierRatios.names(), self.ratios.as_tuple())),
            "key_ratios": None if self.key_ratios is None else dict(zip(TierRatios.names(), self.key_ratios.as_tuple())),
            "layer_ratios": None if self.layer_ratios is None
            else [dict(zip(TierRatios.names(), r.as_tuple())) for r in self.layer_ratios],
            "best_loss": self.best_loss,
            "best_kl": self.best_kl,
            "trials": self.trials,
            "metadata": self.metadata,
            "history": self.history,
        }


def study_name(
    fingerprint: str, bavg: float, settings: dict, seed: int, kl_scale: str = "log", asymmetric: bool = False
) -> str:
    """Deterministic, so that re-running the same calibration continues the same study."""
    parts = [f"{k}={settings[k]}" for k in CACHE_SETTINGS if k in settings and settings[k] is not None]
    if kl_scale != "log":
        parts.append(f"kl_scale={kl_scale}")
    if asymmetric:
        parts.append("asymmetric")
    return f"hqekv-{fingerprint[:16]}-bavg{bavg:g}-seed{seed}" + ("-" + ",".join(parts) if parts else "")


def run_study(
    objective: CompressionObjective,
    bavg: float,
    *,
    trials: int = DEFAULT_TRIALS,
    storage: str | None = None,
    name: str = "hqekv",
    seed: int = 0,
    alpha: float = ALPHA,
    beta: float = BETA,
    kl_scale: str = "log",
    progress: bool = True,
    worker: int = 0,
    asymmetric: bool = False,
) -> CalibrationResult:
    """Run (or continue) one TPE study until it holds ``trials`` completed trials.

    ``objective``: a :class:`CompressionObjective` (``kl``) or :class:`SegmentedObjective`
    (``kls``, one KL per segment); a trial's loss is the mean data term over the segments
    plus α·δ3 + β·δ4 (δ3 the mean of the key and value 1-bit shares).

    ``asymmetric``: search keys and values apart: four variables, the key/value budget
    split ``shift`` (keys bavg + shift, values bavg − shift), the shared evicted share and
    each component's 1-bit share as a fraction of its feasible range
    (:func:`split_ratios_from_free`). False (default): the paper's two
    (δ3, δ4), one set of ratios for both. Infeasible samples (δ1 < 0 or δ2 < 0) are pruned without running the model. Several
    processes may run this on one RDB ``storage``; each stops once the study is complete.
    The sampler is seeded with ``seed + worker`` so that workers propose different trials.
    """
    import optuna
    from optuna.trial import TrialState
    from tqdm.auto import tqdm

    bavg = check_bavg(bavg)
    hi3, hi4 = search_box(bavg)
    data_term(1.0, kl_scale)  # validates the name before any work
    if not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be a positive integer, got {trials!r}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=name,
        storage=storage,
        load_if_exists=True,
        direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=seed + worker),
    )
    for key, value in (("bavg", bavg), ("alpha", alpha), ("beta", beta), ("kl_scale", kl_scale), ("asymmetric", asymmetric)):
        stored = study.user_attrs.get(key)
        if stored is not None and stored != value:
            raise ValueError(f"study {name!r} in {storage} was run with {key}={stored!r}, not {value!r}")
        study.set_user_attr(key, value)

    def completed() -> int:
        return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))

    def evaluate(trial) -> float:
        if asymmetric:
            shift = trial.suggest_float("shift", -shift_box(bavg), shift_box(bavg))
            u3k = trial.suggest_float("u3k", 0.0, 1.0)
            u3v = trial.suggest_float("u3v", 0.0, 1.0)
            x4 = trial.suggest_float("x4", 0.0, hi4)
            pair = split_ratios_from_free(bavg, shift, u3k, u3v, x4)
            if pair is None:
                raise optuna.TrialPruned("infeasible: no 1-bit share makes δ1, δ2 ≥ 0 for keys or values")
            key_ratios, ratios = pair
            x3 = (key_ratios.int1 + ratios.int1) / 2
            trial.set_user_attr("x3k", key_ratios.int1)
            trial.set_user_attr("x3v", ratios.int1)
        else:
            x3 = trial.suggest_float("x3", 0.0, hi3)
            x4 = trial.suggest_float("x4", 0.0, hi4)
            ratios, key_ratios = ratios_from_free(bavg, x3, x4), None
            if ratios is None:
                raise optuna.TrialPruned("infeasible: δ1 < 0 or δ2 < 0")
        start = time.perf_counter()
        kls = segment_kls(objective, ratios, key_ratios)
        trial.set_user_attr("kl", statistics.fmean(kls))
        if len(kls) > 1:
            trial.set_user_attr("kls", kls)
        trial.set_user_attr("seconds", time.perf_counter() - start)
        return statistics.fmean(data_term(kl, kl_scale) for kl in kls) + alpha * x3 + beta * x4

    done = completed()
    bar = tqdm(total=trials, initial=min(done, trials), desc=f"calibrate bavg={bavg:g}", disable=not progress)
    attempts = 0
    while done < trials:
        # Infeasible samples are free; the cap only stops a pathological sampler.
        if attempts > 50 * trials:
            raise RuntimeError(f"study {name!r}: {attempts} samples gave only {done} feasible trials")
        study.optimize(evaluate, n_trials=1, catch=())
        attempts += 1
        now = completed()
        bar.update(min(now, trials) - min(done, trials))
        done = now
    bar.close()
    return _result(study, bavg)


def study_result(storage: str, name: str, bavg: float) -> CalibrationResult:
    """The result of a study as it stands in ``storage`` (e.g. once every worker is done)."""
    import optuna

    return _result(optuna.load_study(study_name=name, storage=storage), bavg)


def _result(study, bavg: float) -> CalibrationResult:
    from optuna.trial import TrialState

    history = []
    for t in study.get_trials(deepcopy=False):
        history.append(
            {
                "number": t.number,
                "state": t.state.name,
                **{name: t.params.get(name) for name in ("x3", "x4", "shift", "u3k", "u3v") if name in t.params},
                **{name: t.user_attrs[name] for name in ("x3k", "x3v") if name in t.user_attrs},
                "loss": t.value,
                "kl": t.user_attrs.get("kl"),
                "kls": t.user_attrs.get("kls"),
                "seconds": t.user_attrs.get("seconds"),
            }
        )
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    if not complete:
        raise RuntimeError(f"study {study.study_name!r} has no completed trial")
    best = min(complete, key=lambda t: t.value)
    p = best.params
    if "shift" in p:
        key_ratios, ratios = split_ratios_from_free(bavg, p["shift"], p["u3k"], p["u3v"], p["x4"])
    else:
        key_ratios, ratios = None, ratios_from_free(bavg, p["x3"], p["x4"])
    return CalibrationResult(
        bavg=bavg,
        ratios=ratios,
        key_ratios=key_ratios,
        best_loss=float(best.value),
        best_kl=float(best.user_attrs["kl"]),
        trials=len(complete),
        history=history,
    )


def calibration_cost(
    bavgs: Sequence[float], trials: int, per_layer: bool, n_layers: int, setup_seconds: float, trial_seconds: float
) -> tuple[int, float]:
    """Trials :func:`calibrate` scores for ``bavgs`` and the seconds they should take, from
    the measured seconds of one trial: ``trials`` per bavg, and with ``per_layer`` one per
    layer and one per strength of :data:`LAYER_STRENGTHS` more. -> (trials, seconds), the
    setup (already run) included."""
    n = len(bavgs) * (trials + (n_layers + len(LAYER_STRENGTHS) if per_layer else 0))
    return n, setup_seconds + n * trial_seconds


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def calibrate(
    model,
    tokenizer,
    bavg: float | Sequence[float] = 3.2,
    *,
    trials: int = DEFAULT_TRIALS,
    storage: str | None = None,
    out: str | Path | None = None,
    seed: int = 0,
    context_tokens: int | None = None,
    segments: int = DEFAULT_SEGMENTS,
    continuation_tokens: int = CONTINUATION_TOKENS,
    alpha: float = ALPHA,
    beta: float = BETA,
    kl_scale: str = "log",
    asymmetric: bool = False,
    per_layer: bool = False,
    model_id: str | None = None,
    progress: bool = True,
    barrier=None,
    worker: int = 0,
    **settings,
) -> CalibrationResult | list[CalibrationResult]:
    """Find the tier ratios of ``model`` at each ``bavg`` by TPE (SPEC §1.5).

    Parameters
    ----------
    model, tokenizer : an unpatched Hugging Face causal LM of a supported architecture
    bavg : float or sequence of floats in (0, 4)
        One study per value; the calibration prefill is shared.
    trials : int, default 200
        Completed (feasible) trials per study; a re-run continues the study up to this count.
    storage : Optuna storage URL, optional
        None keeps the studies in memory; ``sqlite:///study.db`` makes them resumable; any
        RDB URL lets several workers share them.
    out : directory, optional
        Where to write one artifact per bavg (see :mod:`hqekv.artifacts`) and its report.
    seed : int
        Seed of the TPE sampler.
    segments, context_tokens, continuation_tokens : int
        The calibration text is cut into ``segments`` consecutive (context, continuation)
        pairs; each context is prefilled once and its continuation scored. The context
        defaults to ``CALIBRATION_TOKENS / segments - continuation_tokens`` (4 × (3968 + 128):
        the paper's 16K tokens of text), capped so that context and continuation fit the
        model's ``max_position_embeddings``: past its trained context a model's
        distributions are off-distribution noise, and so is their KL (:func:`context_length`).
    alpha, beta : float
        Penalties on δ3 and δ4 in the objective.
    kl_scale : {"log", "linear"}, default "log"
        Data term: ln of the mean KL, on which α, β are tie-breakers (:func:`data_term`), or
        the mean KL itself (the paper's scale, under which the regulariser decides alone).
    asymmetric : bool, default False
        Search separate key and value ratios under the one budget (:func:`run_study`).
        False searches one set for both, as the paper does; on SmolLM2 the separate search
        did not win at equal bytes (``docs/results.md``, ablation).
    per_layer : bool, default False
        After the search, split its budget over the layers by their measured sensitivity
        (:func:`layer_budgets`: one trial's cost per layer plus one per strength tried) and
        record the per-layer ratios in the artifact when the split lowers the loss. Not
        with ``asymmetric``.
    model_id : str, optional
        Recorded in the artifact; defaults to the model's ``name_or_path``.
    barrier : callable, optional
        With several workers on one ``storage``: called when this worker's study is done
        (e.g. ``accelerate.PartialState().wait_for_everyone``); the result is then read
        back from the storage, so that it covers every worker's trials. Give ``out`` to one
        worker only, and each its own ``worker`` index (it offsets the sampler seed).
    **settings : HqeKVConfig fields other than the ratios (chunk_size, window, ...)
        ``rotation`` defaults to None here: the search runs in the unrotated basis, whose
        ratios measured better per byte in the rotated cache too (``docs/calibration.md``).

    Returns one :class:`CalibrationResult` per bavg (a list if ``bavg`` is a sequence).
    """
    from . import __version__
    from .artifacts import model_fingerprint, save_artifact, write_report
    from .data import calibration_text

    if barrier is not None and storage is None:
        raise ValueError("workers that share a study need a shared storage URL")
    if per_layer and asymmetric:
        raise ValueError("per_layer and asymmetric cannot be combined: per-layer budgets hold for keys and values alike")
    data_term(1.0, kl_scale)
    single = not isinstance(bavg, (list, tuple))
    values = [check_bavg(b) for b in ([bavg] if single else bavg)]
    for b in values:
        search_box(b)
    context_tokens = context_length(model, context_tokens, continuation_tokens, segments)
    text = calibration_text(tokenizer, context_tokens, continuation_tokens, segments)
    settings.setdefault("rotation", SEARCH_ROTATION)
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else (lambda line: None)
    device = next(model.parameters()).device
    say(f"hqekv calibrate: {len(values)} bavg × {trials} trials on {device}; first each of {text.context.shape[0]} "
        f"segments ({text.context.shape[1]} context + {text.continuation.shape[1]} continuation tokens) is prefilled "
        "once and one trial timed")  # fmt: skip
    objective = SegmentedObjective(model, text.context, text.continuation, **settings)
    n_trials, seconds = calibration_cost(
        values, trials, per_layer, objective.n_layers, objective.setup_seconds, objective.trial_seconds
    )
    say(f"hqekv calibrate: prefill {_duration(objective.setup_seconds)}, one trial {objective.trial_seconds:.2f} s: "
        f"{n_trials} trials, about {_duration(seconds)} in all (a study resumed from its storage runs only its "
        "missing trials)")  # fmt: skip
    fingerprint = model_fingerprint(model)
    config = objective.config
    results = []
    for b in values:
        name = study_name(fingerprint, b, objective.settings, seed, kl_scale, asymmetric)
        start = time.perf_counter()
        result = run_study(
            objective, b, trials=trials, storage=storage, name=name, seed=seed, alpha=alpha, beta=beta,
            kl_scale=kl_scale, progress=progress, worker=worker, asymmetric=asymmetric,
        )
        if barrier is not None:
            barrier()
            result = study_result(storage, name, b)
        result.metadata = {
            "model_id": model_id or getattr(model.config, "_name_or_path", "") or model.config.model_type,
            "model_type": model.config.get_text_config().model_type,
            "config_fingerprint": fingerprint,
            "bavg": b,
            **{name: getattr(config, name) for name in CACHE_SETTINGS},
            "asymmetric": asymmetric,
            "per_layer": per_layer,
            "alpha": alpha,
            "beta": beta,
            "kl_scale": kl_scale,
            "trials": result.trials,
            "best_loss": result.best_loss,
            "best_kl": result.best_kl,
            "seed": seed,
            "study_name": name,
            "calibration_data": text.description,
            "calibration_data_sha256": text.sha256,
            "segments": text.context.shape[0],
            "context_tokens": text.context.shape[1],
            "continuation_tokens": text.continuation.shape[1],
            "library_version": __version__,
            "setup_seconds": round(objective.setup_seconds, 3),
            "study_seconds": round(time.perf_counter() - start, 3),
        }
        if per_layer:
            budgets = layer_budgets(objective, result.ratios, alpha=alpha, beta=beta, kl_scale=kl_scale)
            result.layer_ratios = budgets.layer_ratios
            result.metadata.update(budgets.metadata())
            chosen = min(budgets.search, key=lambda row: row["loss"])
            result.best_loss, result.best_kl = chosen["loss"], chosen["kl"]
            result.metadata.update(best_loss=result.best_loss, best_kl=result.best_kl)
        if out is not None:
            result.path = save_artifact(Path(out), result.ratios, result.metadata, key_ratios=result.key_ratios,
                                        layer_ratios=result.layer_ratios)  # fmt: skip
            write_report(result)
        results.append(result)
    return results[0] if single else results



def split_artifact(model, tokenizer, artifact, *, out: str | Path | None = None, strengths: Sequence[float] = LAYER_STRENGTHS,
                   progress: bool = True) -> CalibrationResult:  # fmt: skip
    """Per-layer budgets (:func:`layer_budgets`) for the ratios of an existing artifact,
    without re-running its search: what ``calibrate(..., per_layer=True)`` adds after the
    search, on the same calibration text, settings, α, β and data term as the artifact's.

    ``artifact``: a path or :class:`~hqekv.artifacts.Artifact` of one set of ratios for
    ``model`` (fingerprint checked). Writes the new artifact to ``out`` (a directory or
    ``.safetensors`` path) when given: the artifact's metadata plus the per-layer fields
    (``per_layer``, ``layer_strength``, ``layer_sensitivity``, ``layer_search``,
    ``layer_seconds``, ``split_from``). Takes one trial's time per layer plus one per strength.
    """
    from . import __version__
    import json

    from .artifacts import (
        Artifact, ArtifactError, check_fits, check_splittable, load_artifact, report_path, save_artifact, write_report,
    )  # fmt: skip
    from .data import calibration_text

    base = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
    meta = dict(base.metadata)
    check_splittable(base)
    check_fits(base, model)
    segments = meta.get("segments", 1)
    context_tokens, continuation_tokens = meta.get("context_tokens"), meta.get("continuation_tokens")
    if not (isinstance(context_tokens, int) and isinstance(continuation_tokens, int) and isinstance(segments, int)):
        raise ArtifactError(f"{base.path} does not record its calibration text's segments and lengths")
    text = calibration_text(tokenizer, context_tokens, continuation_tokens, segments)
    if text.sha256 != meta["calibration_data_sha256"]:
        raise ArtifactError(f"{base.path} was calibrated on other text (sha256 {meta['calibration_data_sha256'][:12]}) than "
                            f"this tokenizer gives ({text.sha256[:12]})")  # fmt: skip
    settings = {name: meta[name] for name in CACHE_SETTINGS if name in meta}
    objective = SegmentedObjective(model, text.context, text.continuation, **settings)
    kl_scale = meta.get("kl_scale", "log")
    budgets = layer_budgets(objective, base.ratios, strengths=strengths, alpha=meta["alpha"], beta=meta["beta"],
                            kl_scale=kl_scale)  # fmt: skip
    chosen = min(budgets.search, key=lambda row: row["loss"])
    meta.update(budgets.metadata(), per_layer=True, best_loss=chosen["loss"], best_kl=chosen["kl"],
                split_from=base.path.name, library_version=__version__)  # fmt: skip
    meta.pop("format", None), meta.pop("format_version", None), meta.pop("ratios", None)
    report = report_path(base.path)
    history = json.loads(report.read_text()).get("history", []) if report.is_file() else []  # the search's trials
    result = CalibrationResult(bavg=base.bavg, ratios=base.ratios, best_loss=chosen["loss"], best_kl=chosen["kl"],
                               trials=meta["trials"], history=history, metadata=meta, layer_ratios=budgets.layer_ratios)  # fmt: skip
    if out is not None:
        result.path = save_artifact(Path(out), result.ratios, meta, layer_ratios=result.layer_ratios)
        write_report(result)
    return result

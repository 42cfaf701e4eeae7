"""Per-layer budgets: each compressed layer's share of the model's bavg, from each layer's
sensitivity (the KL when it alone is compressed), at a few strengths."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Sequence

from ..allocation import split_budget
from ..config import FP16_RATIOS, TierRatios, check_bavg
from .objective import ALPHA, BETA, data_term, segment_kls


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


PROFILE_BITS = 1.0
"""The budget at which :func:`allocator_sensitivity` measures a layer profile: low enough
that every layer's loss is well above the noise of a short continuation."""


def allocator_sensitivity(objective, bits: float = PROFILE_BITS) -> list[float]:
    """Mean KL with compressed layer l alone under the rate-distortion allocator at ``bits``
    (its own budget) and every other layer FP16, per layer, over the objective's segments.

    What ``patch_model(model, ratios="auto", layer_bits=...)`` needs to split any budget
    (:func:`hqekv.allocation.split_budget`). Per segment it costs one compressed prefill
    and one continuation forward per layer (:meth:`CompressionObjective.allocator_layers`),
    not one prefill per layer.
    """
    parts = getattr(objective, "parts", [objective])
    total = [0.0] * objective.n_layers
    for part in parts:
        for i, kl in enumerate(part.layer_kls(part.allocator_layers(bits))):
            total[i] += kl / len(parts)
    return total


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

"""The search space of the ratio search: tier shares from the two free shares (δ3, δ4) under
the budget's constraints (SPEC eq. (6)), and the box TPE samples them in."""

from __future__ import annotations


from ..config import TierRatios, check_bavg


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

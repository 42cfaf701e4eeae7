"""Offline search of the tier ratios: Optuna TPE over (δ3, δ4) (paper Algorithm 1, SPEC §1.5).

- ``search_space.py``: tier shares from the free shares (δ3, δ4) and the box TPE searches;
- ``objective.py``: what a trial scores, the KL of the compressed model's next-token
  distributions on a continuation, from a context prefilled once;
- ``layer_budgets.py``: per-layer budgets from each layer's sensitivity;
- ``study.py``: the study, its result and cost, :func:`calibrate` and :func:`split_artifact`;
- ``profile.py``: :func:`measure_profile`, the layer profile the allocator splits budgets by.
"""

from .layer_budgets import (
    LAYER_STRENGTHS, PROFILE_BITS, LayerBudgets, allocator_sensitivity, layer_budgets, layer_sensitivity, ratios_at,
    split_budget,
)  # fmt: skip
from .objective import (
    ALPHA,
    BETA,
    CALIBRATION_TOKENS,
    CONTEXT_TOKENS,
    CONTINUATION_TOKENS,
    KL_FLOOR,
    KL_SCALES,
    CompressionObjective,
    SegmentedObjective,
    context_length,
    data_term,
    mean_kl,
    reference_style_kl,
    segment_kls,
    trial_layer,
)
from .profile import measure_profile
from .search_space import one_bit_range, ratios_from_free, search_box, shift_box, split_ratios_from_free
from .study import (
    DEFAULT_SEGMENTS,
    DEFAULT_TRIALS,
    SEARCH_ROTATION,
    CalibrationResult,
    calibrate,
    calibration_cost,
    run_study,
    split_artifact,
    study_name,
    study_result,
)

__all__ = [
    "ALPHA", "BETA", "CALIBRATION_TOKENS", "CONTEXT_TOKENS", "CONTINUATION_TOKENS", "DEFAULT_SEGMENTS",
    "DEFAULT_TRIALS", "KL_FLOOR", "KL_SCALES", "LAYER_STRENGTHS", "PROFILE_BITS", "SEARCH_ROTATION", "CalibrationResult",
    "CompressionObjective", "LayerBudgets", "SegmentedObjective", "allocator_sensitivity", "calibrate", "calibration_cost", "context_length",
    "data_term", "layer_budgets", "layer_sensitivity", "mean_kl", "measure_profile", "one_bit_range", "ratios_at", "ratios_from_free",
    "reference_style_kl", "run_study", "search_box", "segment_kls", "shift_box", "split_artifact", "split_budget",
    "split_ratios_from_free", "study_name", "study_result", "trial_layer",
]  # fmt: skip

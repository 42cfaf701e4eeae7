"""hqekv: HqeKV mixed-precision KV-cache compression for Hugging Face causal LMs.

``hqekv.patch_model(model, bavg=3.2)`` keeps every 32-token chunk of the cache in FP16,
4-bit, 2-bit or 1-bit, or evicts it, by a joint K-V importance metric (HqeKV, Findings of
ACL 2026).
"""

from .cache import HqeKVCache, HqeKVLayer, SlidingWindowLayer
from .config import FP16_RATIOS, HqeKVConfig, TierRatios, uncalibrated_ratios
from .calibration import calibrate
from .memory import MemoryReport
from .patches import SUPPORTED_MODEL_TYPES
from .patching import (
    DEFAULT_BAVG,
    UncalibratedRatiosWarning,
    is_patched,
    memory_report,
    new_cache,
    patch_config,
    patch_model,
    unpatch_model,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BAVG",
    "FP16_RATIOS",
    "HqeKVCache",
    "HqeKVConfig",
    "HqeKVLayer",
    "MemoryReport",
    "SUPPORTED_MODEL_TYPES",
    "SlidingWindowLayer",
    "TierRatios",
    "UncalibratedRatiosWarning",
    "calibrate",
    "is_patched",
    "memory_report",
    "new_cache",
    "patch_config",
    "patch_model",
    "uncalibrated_ratios",
    "unpatch_model",
]

"""Where hqekv keeps files for a user: ``$HQEKV_CACHE``, else ``~/.cache/hqekv``.

One directory, one variable, for everything hqekv writes outside a project: the CPU
kernel library (built once per source, compiler and CPU; :mod:`hqekv.kernels.mixed_attention_cpu`), the
packaged models joined from their parts (:mod:`hqekv.packaged_models`), and the artifacts
``hqekv calibrate`` writes by default, which ``patch_model`` finds by itself
(:data:`ARTIFACTS`, :mod:`hqekv.artifacts`).
"""

from __future__ import annotations

import os
from pathlib import Path

VARIABLE = "HQEKV_CACHE"
ARTIFACTS = "artifacts"
"""The subdirectory of calibrated artifacts."""


def cache_dir() -> Path:
    """``$HQEKV_CACHE`` (``~`` expanded), else ``~/.cache/hqekv``; not created here."""
    value = os.environ.get(VARIABLE)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "hqekv"


def artifacts_dir() -> Path:
    """Where ``hqekv calibrate`` writes artifacts by default and ``patch_model`` looks for them."""
    return cache_dir() / ARTIFACTS

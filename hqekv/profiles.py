"""Layer profiles: how much each compressed layer of a model suffers under the
rate-distortion allocator, measured once per model (``hqekv calibrate --model M --profile``),
so that ``patch_model`` gives each layer its own share of any budget (``layer_bits``).

One file per model and cache settings, ``<model>-layers.safetensors``: a float64 tensor
``layer_sensitivity`` with one entry per global attention layer (the mean KL of a
calibration continuation with that layer alone under the allocator at ``bits`` and every
other layer in full precision) and string metadata (JSON values) as an artifact's: model
id, config fingerprint, the cache settings it was measured with (``MATCHED_SETTINGS``),
``bits``, the calibration data and its hash, library and format versions. Found like
artifacts: in ``$HQEKV_CACHE/artifacts``, in the local Hub cache of the model's
conventional repo, then among those shipped in the package (:func:`find_profile`).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .allocation import LAYER_STRENGTH, split_budget
from . import artifacts
from .artifacts import (
    MATCHED_SETTINGS, PROFILE_SUFFIX, ArtifactError, ArtifactWarning, artifact_slug, check_fields, hub_cached, hub_repo,
    read_hqekv_file,
)  # fmt: skip
from .user_cache import atomic_write

FORMAT = "hqekv-layer-profile"
FORMAT_VERSION = 1
REQUIRED = (
    "format", "format_version", "model_id", "config_fingerprint", *MATCHED_SETTINGS, "bits", "calibration_data",
    "calibration_data_sha256", "library_version",
)  # fmt: skip
FIELD_CHECKS = {
    **{k: artifacts.FIELD_CHECKS[k] for k in ("model_id", "config_fingerprint", *MATCHED_SETTINGS, "calibration_data",
                                              "calibration_data_sha256", "library_version")},
    "bits": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 < v < 16,
             "a number in (0, 16)"),
}  # fmt: skip
"""What each metadata field of a profile must hold (those it shares with artifacts as they must)."""


@dataclass(frozen=True)
class LayerProfile:
    """A loaded layer profile: per-layer sensitivities and metadata (values decoded from JSON)."""

    path: Path
    sensitivity: tuple[float, ...]
    metadata: dict

    @property
    def fingerprint(self) -> str:
        return self.metadata["config_fingerprint"]

    def settings(self) -> dict:
        return {k: self.metadata[k] for k in MATCHED_SETTINGS}

    def layer_bits(self, bavg: float, strength: float = LAYER_STRENGTH) -> list[float]:
        """Each compressed layer's budget, averaging ``bavg`` (:func:`hqekv.allocation.split_budget`)."""
        return split_budget(bavg, self.sensitivity, strength)

    def describe(self) -> str:
        lines = [f"{self.path}", f"  layer sensitivity (KL at {self.metadata['bits']:g} bits): "
                 + ", ".join(f"{s:.3g}" for s in self.sensitivity),
                 "  per-layer budgets at bavg 2: " + ", ".join(f"{b:.2f}" for b in self.layer_bits(2.0))]  # fmt: skip
        lines += [f"  {k}: {v}" for k, v in sorted(self.metadata.items()) if k != "layer_sensitivity"]
        return "\n".join(lines)


def profile_filename(model_id: str) -> str:
    return artifact_slug(model_id) + PROFILE_SUFFIX


def _check_sensitivity(values) -> tuple[float, ...]:
    values = tuple(float(v) for v in values)
    if not values or not all(math.isfinite(v) and v >= 0 for v in values):
        raise ArtifactError(f"a layer profile needs one finite sensitivity >= 0 per layer, got {list(values)}")
    return values


def save_profile(out: Path | str, sensitivity, metadata: dict) -> Path:
    """Write a profile; ``out`` is a directory (file named after the model id) or a ``-layers.safetensors`` path."""
    from safetensors.torch import save

    sensitivity = _check_sensitivity(sensitivity)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, **metadata, "layer_sensitivity": list(sensitivity)}
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        raise ArtifactError(f"layer profile metadata lacks {missing}")
    out = Path(out)
    path = out if out.name.endswith(PROFILE_SUFFIX) else out / profile_filename(str(meta["model_id"]))
    tensors = {"layer_sensitivity": torch.tensor(sensitivity, dtype=torch.float64)}
    with atomic_write(path) as f:
        f.write(save(tensors, metadata={k: json.dumps(v) for k, v in meta.items()}))
    return path


def load_profile(path: Path | str) -> LayerProfile:
    """Read and validate a profile file; any defect raises :class:`~hqekv.artifacts.ArtifactError`."""
    path = Path(path)
    meta, tensors = read_hqekv_file(path, "layer profile", FORMAT, FORMAT_VERSION, REQUIRED, ("layer_sensitivity",))
    check_fields(path, meta, FIELD_CHECKS)
    tensor = tensors["layer_sensitivity"]
    if tensor is None or tensor.dim() != 1 or tensor.dtype != torch.float64:
        raise ArtifactError(f"{path}: expected a float64 vector 'layer_sensitivity'")
    sensitivity = _check_sensitivity(tensor.tolist())
    if list(sensitivity) != meta.get("layer_sensitivity"):
        raise ArtifactError(f"{path}: layer_sensitivity tensor disagrees with its metadata: corrupt")
    return LayerProfile(path, sensitivity, meta)


def check_profile(profile: LayerProfile, fingerprint: str, settings: dict, n_layers: int | None = None) -> None:
    """Raise :class:`~hqekv.artifacts.ArtifactError` unless ``profile`` fits this model and cache settings."""
    if profile.fingerprint != fingerprint:
        raise ArtifactError(f"{profile.path} was measured for {profile.metadata['model_id']!r} (config fingerprint "
                            f"{profile.fingerprint[:12]}), not for this model ({fingerprint[:12]})")  # fmt: skip
    made_with = profile.settings()
    wrong = {k: (made_with[k], settings[k]) for k in MATCHED_SETTINGS if k in settings and made_with[k] != settings[k]}
    if wrong:
        detail = ", ".join(f"{k}: profile {a!r} vs {b!r}" for k, (a, b) in wrong.items())
        raise ArtifactError(f"{profile.path} was measured with other cache settings ({detail})")
    if n_layers is not None and len(profile.sensitivity) != n_layers:
        raise ArtifactError(f"{profile.path} profiles {len(profile.sensitivity)} layers; this model compresses {n_layers}")


def _directory_profiles(directory: Path) -> list[LayerProfile]:
    out = []
    for p in sorted(directory.glob(f"*{PROFILE_SUFFIX}")):
        try:
            out.append(load_profile(p))
        except ArtifactError as err:
            warnings.warn(f"hqekv: skipping unreadable layer profile {p}: {err}", ArtifactWarning, stacklevel=3)
    return out


def shipped_profiles() -> list[LayerProfile]:
    """The layer profiles shipped inside the package."""
    return [load_profile(p) for p in sorted(artifacts.SHIPPED_DIR.glob(f"*{PROFILE_SUFFIX}"))]


def find_profile(model_id: str, fingerprint: str, settings: dict) -> LayerProfile | None:
    """The layer profile for this model and settings that ``patch_model`` finds by itself,
    without the network: first among those ``hqekv calibrate --profile`` wrote to
    ``$HQEKV_CACHE/artifacts``, then in the local Hub cache of the model's conventional
    repo (:func:`~hqekv.artifacts.hub_repo`), then among the shipped ones."""
    from .user_cache import artifacts_dir

    repo = hub_repo(model_id)
    for directory in (artifacts_dir(), hub_cached(repo) if repo else None, artifacts.SHIPPED_DIR):
        if directory is None or not directory.is_dir():
            continue
        for profile in _directory_profiles(directory):
            try:
                check_profile(profile, fingerprint, settings)
            except ArtifactError:
                continue
            return profile
    return None

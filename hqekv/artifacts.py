"""Calibrated tier ratios as safetensors artifacts (SPEC §1.5, §2).

One file per (model, bavg): a float64 tensor ``ratios`` = (fp16, δ1, δ2, δ3, δ4) (of the
values, and of the keys unless an optional ``key_ratios`` tensor gives the keys' own; an
optional (L, 5) ``layer_ratios`` tensor gives per-layer budgets, one row per global
attention layer) and string
metadata (JSON-encoded values): model id and config fingerprint, bavg, the cache settings
it was calibrated for (G, m, T, ...), α, β, trials, best loss, the calibration data and its
hash, library and format versions. Artifacts are found as a file, a directory, a Hub repo
id, or among those shipped inside the package (``hqekv/artifacts/``).
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from .config import EVICTION_CRITERIA, MAX_BAVG, TierRatios, check_one_evicted_set, layer_mean_bavg, mean_bavg
from .user_cache import atomic_write

FORMAT = "hqekv-ratios"
FORMAT_VERSION = 1
SHIPPED_DIR = Path(__file__).parent / "artifacts"
SUFFIX = ".safetensors"
PROFILE_SUFFIX = "-layers" + SUFFIX
"""How the file of a model's layer profile ends (:mod:`hqekv.profiles`), next to its
artifacts (``<model>-bavg<B>.safetensors``): the artifacts' searches skip it."""
SUPERSEDED = (
    "gemma-3-270m-bavg2.safetensors",
    "gemma-3-270m-bavg3.2.safetensors",
    "qwen2.5-coder-0.5b-instruct-bavg2.safetensors",
)
"""Shipped artifacts that the rate-distortion allocator beats at the same real bytes, on
samples their calibration never read (docs/results.md, Gemma-3-270M; Qwen2.5-Coder at bavg 2,
its layers at budgets split by the sensitivity the artifact measured): ``patch_model`` runs
the allocator at the bytes their shares spend instead; ``ratios="calibrated"`` still
takes them."""

FINGERPRINT_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rope_theta",
)
"""Architecture fields that decide the K/V a model produces; the fingerprint hashes them."""

OPTIONAL_FINGERPRINT_FIELDS = ("sliding_window", "layer_types")
"""Hashed too where a model sets them (sliding-window models), so fingerprints of models
without them stay what they were."""

MATCHED_SETTINGS = ("chunk_size", "window", "rerank_interval", "protected_chunks", "eviction", "value_group")
"""Cache settings an artifact was calibrated for and must be used with.

Not the rotation: ratios are shares of chunks per tier, valid in either basis, and the
rotated cache with ratios searched unrotated measured better per byte than ratios searched
rotated (``docs/results.md``, ablation). Artifacts record the basis they were searched in
(``rotation``; absent: none)."""

REQUIRED = (
    "format",
    "format_version",
    "model_id",
    "config_fingerprint",
    "bavg",
    *MATCHED_SETTINGS,
    "alpha",
    "beta",
    "trials",
    "best_loss",
    "calibration_data",
    "calibration_data_sha256",
    "library_version",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ArtifactError(ValueError):
    """An artifact is missing, unreadable, corrupt, or made for another model, bavg or setting."""


def fingerprint_fields(model_or_config) -> dict:
    """The architecture fields of a model or config that :func:`model_fingerprint` hashes."""
    config = getattr(model_or_config, "config", model_or_config)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    fields = {}
    for name in FINGERPRINT_FIELDS:
        if name == "head_dim":
            value = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        elif name == "rope_theta":
            rope = getattr(config, "rope_parameters", None) or {}
            if "rope_theta" not in rope and isinstance(rope.get("full_attention"), dict):
                rope = rope["full_attention"]  # per layer type (Gemma3): the global layers' RoPE
            value = rope.get("rope_theta", getattr(config, "rope_theta", None))
        elif name == "num_key_value_heads":
            value = getattr(config, name, None) or config.num_attention_heads
        else:
            value = getattr(config, name, None)
        fields[name] = float(value) if isinstance(value, float) else value
    for name in OPTIONAL_FINGERPRINT_FIELDS:
        value = getattr(config, name, None)
        if value is not None and not (name == "layer_types" and set(value) == {"full_attention"}):
            fields[name] = list(value) if name == "layer_types" else value
    return fields


def model_fingerprint(model_or_config) -> str:
    """sha256 of the architecture fields, stable across loaders (Hub, GGUF, local)."""
    blob = json.dumps(fingerprint_fields(model_or_config), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class Artifact:
    """A loaded artifact: its ratios and metadata (values decoded from JSON)."""

    path: Path
    ratios: TierRatios
    metadata: dict
    key_ratios: TierRatios | None = None
    layer_ratios: tuple[TierRatios, ...] | None = None

    @property
    def bavg(self) -> float:
        return float(self.metadata["bavg"])

    @property
    def fingerprint(self) -> str:
        return self.metadata["config_fingerprint"]

    def settings(self) -> dict:
        return {k: self.metadata[k] for k in MATCHED_SETTINGS}

    def describe(self) -> str:
        lines = [f"{self.path}", f"  ratios: {self.ratios.describe()}  (bavg {self.ratios.bavg:.4g})"]
        if self.key_ratios is not None:
            lines[-1] = f"  value ratios: {self.ratios.describe()}  (bavg {self.ratios.bavg:.4g})"
            lines.append(f"  key ratios: {self.key_ratios.describe()}  (bavg {self.key_ratios.bavg:.4g})")
        if self.layer_ratios is not None:
            lines.append(f"  per-layer budgets (bits): {', '.join(f'{r.bavg:.2f}' for r in self.layer_ratios)}")
        lines += [f"  {k}: {v}" for k, v in sorted(self.metadata.items()) if k != "layer_ratios"]
        if self.superseded:
            split = ", each layer at a budget split by layer_sensitivity" if "layer_sensitivity" in self.metadata else ""
            lines.append("  superseded: patch_model runs the rate-distortion allocator at the bytes these shares "
                         f"spend{split}; ratios='calibrated' takes them")  # fmt: skip
        return "\n".join(lines)

    @property
    def superseded(self) -> bool:
        """Whether this is a shipped artifact the allocator took the place of (:data:`SUPERSEDED`)."""
        return self.path.name in SUPERSEDED and self.path.resolve().parent == SHIPPED_DIR.resolve()


def artifact_slug(model_id: str) -> str:
    """The start of the names of a model's files: ``Org/Model-1B`` -> ``model-1b``."""
    return re.sub(r"[^a-z0-9.-]+", "-", model_id.rstrip("/").split("/")[-1].lower()).strip("-") or "model"


def artifact_filename(model_id: str, bavg: float) -> str:
    return f"{artifact_slug(model_id)}-bavg{bavg:g}{SUFFIX}"


def save_artifact(
    out: Path | str, ratios: TierRatios, metadata: dict, key_ratios: TierRatios | None = None, layer_ratios=None
) -> Path:
    """Write an artifact; ``out`` is a directory (file named after model id and bavg) or a file path.

    ``key_ratios``: the keys' own shares (``ratios`` are then the values'), stored as a
    second tensor. ``layer_ratios``: per-layer budgets (one :class:`TierRatios` per global
    attention layer, averaging ``metadata["bavg"]``), stored as an (L, 5) tensor.
    """
    from safetensors.torch import save

    ratios = TierRatios.coerce(ratios)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, **metadata, "ratios": list(ratios.as_tuple())}
    tensors = {"ratios": torch.tensor(ratios.as_tuple(), dtype=torch.float64)}
    if key_ratios is not None:
        key_ratios = TierRatios.coerce(key_ratios)
        try:
            check_one_evicted_set(ratios, key_ratios)
        except ValueError as err:
            raise ArtifactError(str(err)) from err
        meta["key_ratios"] = list(key_ratios.as_tuple())
        tensors["key_ratios"] = torch.tensor(key_ratios.as_tuple(), dtype=torch.float64)
    if layer_ratios is not None:
        layer_ratios = [TierRatios.coerce(r) for r in layer_ratios]
        if key_ratios is not None:
            raise ArtifactError("an artifact holds key_ratios or layer_ratios, not both")
        if abs(float(meta["bavg"]) - layer_mean_bavg(layer_ratios)) > 1e-3:
            raise ArtifactError(f"layer ratios average {layer_mean_bavg(layer_ratios):.4g} bits, "
                                f"metadata says bavg {meta['bavg']}")  # fmt: skip
        meta["layer_ratios"] = [list(r.as_tuple()) for r in layer_ratios]
        tensors["layer_ratios"] = torch.tensor([r.as_tuple() for r in layer_ratios], dtype=torch.float64)
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        raise ArtifactError(f"artifact metadata lacks {missing}")
    if abs(float(meta["bavg"]) - mean_bavg(ratios, key_ratios)) > 1e-3:
        raise ArtifactError(f"ratios give bavg {mean_bavg(ratios, key_ratios):.4g}, metadata says {meta['bavg']}")
    out = Path(out)
    path = out if out.suffix == SUFFIX else out / artifact_filename(str(meta["model_id"]), float(meta["bavg"]))
    with atomic_write(path) as f:  # readable by all, and never found cut short by patch_model
        f.write(save(tensors, metadata={k: json.dumps(v) for k, v in meta.items()}))
    return path


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


FIELD_CHECKS = {
    "model_id": (lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
    "config_fingerprint": (lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None,
                           "a sha256 hex digest"),
    "bavg": (lambda v: _is_number(v) and 0 < v <= MAX_BAVG, f"a finite number in (0, {MAX_BAVG:g}]"),
    "chunk_size": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "window": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "rerank_interval": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "protected_chunks": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "eviction": (lambda v: v in EVICTION_CRITERIA, f"one of {EVICTION_CRITERIA}"),
    "value_group": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "alpha": (lambda v: _is_number(v) and v >= 0, "a finite number >= 0"),
    "beta": (lambda v: _is_number(v) and v >= 0, "a finite number >= 0"),
    "trials": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "best_loss": (_is_number, "a finite number"),
    "calibration_data": (lambda v: isinstance(v, str), "a string"),
    "calibration_data_sha256": (lambda v: isinstance(v, str), "a string"),
    "library_version": (lambda v: isinstance(v, str), "a string"),
}  # fmt: skip
"""What each required metadata field must hold; :func:`load_artifact` checks them all."""


def check_fields(path: Path, meta: dict, checks: dict = FIELD_CHECKS) -> None:
    """Raise :class:`ArtifactError` naming every field of ``meta`` that fails its entry of ``checks``."""
    bad = [f"{k}={meta[k]!r} (must be {what})" for k, (ok, what) in checks.items() if not ok(meta[k])]
    if bad:
        raise ArtifactError(f"{path}: invalid metadata: {'; '.join(bad)}")


def read_hqekv_file(path: Path, kind: str, fmt: str, version: int, required, tensors) -> tuple[dict, dict]:
    """The metadata (values decoded from JSON) and the tensors named ``tensors`` (None where
    absent) of an hqekv safetensors file of format ``fmt`` at ``version`` holding every
    ``required`` field; any defect raises :class:`ArtifactError` naming ``kind``."""
    from safetensors import safe_open

    if not path.is_file():
        raise ArtifactError(f"no hqekv {kind} at {path}: file not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
            found = {name: f.get_tensor(name) if name in f.keys() else None for name in tensors}
    except Exception as err:  # safetensors raises its own error types for bad headers and truncation
        raise ArtifactError(f"{path} is not a readable safetensors file (corrupt or truncated?): {err}") from err
    try:
        meta = {k: json.loads(v) for k, v in raw.items()}
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path}: corrupt metadata ({err})") from err
    if meta.get("format") != fmt:
        raise ArtifactError(f"{path} is not an hqekv {kind} (format {meta.get('format')!r})")
    if meta.get("format_version") != version:
        raise ArtifactError(f"{path} has {kind} format version {meta.get('format_version')}; this hqekv reads version "
                            f"{version}")  # fmt: skip
    missing = [k for k in required if k not in meta]
    if missing:
        raise ArtifactError(f"{path}: metadata lacks {missing}")
    return meta, found


def load_artifact(path: Path | str) -> Artifact:
    """Read and validate an artifact file; any defect raises :class:`ArtifactError`."""
    path = Path(path)
    meta, tensors = read_hqekv_file(path, "ratios artifact", FORMAT, FORMAT_VERSION, REQUIRED,
                                    ("ratios", "key_ratios", "layer_ratios"))  # fmt: skip
    tensor, key_tensor, layer_tensor = tensors["ratios"], tensors["key_ratios"], tensors["layer_ratios"]
    check_fields(path, meta)

    def read_ratios(name: str, tensor) -> TierRatios:
        if tensor is None or tensor.shape != (5,) or tensor.dtype != torch.float64:
            raise ArtifactError(f"{path}: expected a float64 tensor {name!r} of 5 entries")
        values = tuple(tensor.tolist())
        if list(values) != meta.get(name):
            raise ArtifactError(f"{path}: {name} tensor {values} disagrees with its metadata {meta.get(name)}: corrupt")
        try:
            return TierRatios(*values)
        except ValueError as err:
            raise ArtifactError(f"{path}: invalid {name} ({err})") from err

    ratios = read_ratios("ratios", tensor)
    key_ratios = None
    if key_tensor is not None or "key_ratios" in meta:
        key_ratios = read_ratios("key_ratios", key_tensor)
        try:
            check_one_evicted_set(ratios, key_ratios)
        except ValueError as err:
            raise ArtifactError(f"{path}: {err}: corrupt") from err
    mean = mean_bavg(ratios, key_ratios)
    if abs(mean - float(meta["bavg"])) > 1e-3:
        raise ArtifactError(f"{path}: ratios give bavg {mean:.4g} but the artifact is for bavg {meta['bavg']}")
    layer_ratios = None
    if layer_tensor is not None or "layer_ratios" in meta:
        layer_ratios = _read_layer_ratios(path, layer_tensor, meta.get("layer_ratios"))
        if key_ratios is not None:
            raise ArtifactError(f"{path}: holds both key_ratios and layer_ratios: corrupt")
        if abs(layer_mean_bavg(layer_ratios) - float(meta["bavg"])) > 1e-3:
            raise ArtifactError(f"{path}: layer ratios average {layer_mean_bavg(layer_ratios):.4g} bits "
                                f"but the artifact is for bavg {meta['bavg']}")  # fmt: skip
    return Artifact(path, ratios, meta, key_ratios, layer_ratios)


def _read_layer_ratios(path: Path, tensor, listed) -> tuple[TierRatios, ...]:
    if tensor is None or tensor.dim() != 2 or tensor.shape[1] != 5 or tensor.shape[0] < 1 or tensor.dtype != torch.float64:
        raise ArtifactError(f"{path}: expected a float64 tensor 'layer_ratios' of shape (layers, 5)")
    rows = [tuple(row) for row in tensor.tolist()]
    if listed != [list(row) for row in rows]:
        raise ArtifactError(f"{path}: layer_ratios tensor disagrees with its metadata: corrupt")
    try:
        return tuple(TierRatios(*row) for row in rows)
    except ValueError as err:
        raise ArtifactError(f"{path}: invalid layer_ratios ({err})") from err


def check_artifact(artifact: Artifact, fingerprint: str, bavg: float | None, settings: dict) -> None:
    """Raise :class:`ArtifactError` unless ``artifact`` fits this model, bavg and cache settings."""
    if artifact.fingerprint != fingerprint:
        raise ArtifactError(
            f"{artifact.path} was calibrated for {artifact.metadata['model_id']!r} "
            f"(config fingerprint {artifact.fingerprint[:12]}), not for this model ({fingerprint[:12]})"
        )
    if bavg is not None and abs(artifact.bavg - bavg) > 1e-6:
        raise ArtifactError(f"{artifact.path} is for bavg={artifact.bavg:g}, not bavg={bavg:g}")
    made_with = artifact.settings()
    wrong = {k: (made_with[k], settings[k]) for k in MATCHED_SETTINGS if k in settings and made_with[k] != settings[k]}
    if wrong:
        detail = ", ".join(f"{k}: artifact {a!r} vs {b!r}" for k, (a, b) in wrong.items())
        raise ArtifactError(f"{artifact.path} was calibrated with other cache settings ({detail})")


def check_splittable(artifact: Artifact) -> None:
    """Raise :class:`ArtifactError` unless ``artifact`` holds one set of ratios for keys and
    values and all layers (what ``hqekv split`` splits)."""
    if artifact.key_ratios is not None or artifact.layer_ratios is not None or artifact.metadata.get("per_layer"):
        raise ArtifactError(f"{artifact.path} already splits its ratios (keys apart, or per layer); split one set of ratios")


def check_fits(artifact: Artifact, model_or_config) -> None:
    """Raise :class:`ArtifactError` unless ``artifact`` was calibrated for this architecture."""
    if artifact.fingerprint != model_fingerprint(model_or_config):
        raise ArtifactError(f"{artifact.path} was calibrated for {artifact.metadata['model_id']!r}, not for this model")


def _first_fitting(candidates: list[Artifact], fingerprint: str, bavg: float, settings: dict) -> Artifact | None:
    for artifact in candidates:
        try:
            check_artifact(artifact, fingerprint, bavg, settings)
        except ArtifactError:
            continue
        return artifact
    return None


class ArtifactWarning(UserWarning):
    """An artifact file in a directory was skipped because it cannot be read."""


def _directory_artifacts(directory: Path) -> list[Artifact]:
    """The readable artifacts of a directory; each unreadable one (a partial download, a corrupt
    file) is skipped with an :class:`ArtifactWarning` naming it."""
    out = []
    for p in sorted(directory.glob(f"*{SUFFIX}")):
        if p.name.endswith(PROFILE_SUFFIX):  # a layer profile (hqekv.profiles), not ratios
            continue
        try:
            out.append(load_artifact(p))
        except ArtifactError as err:
            warnings.warn(f"hqekv: skipping unreadable artifact {p}: {err}", ArtifactWarning, stacklevel=3)
    return out


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=[f"*{SUFFIX}", "*.json"]))
    except Exception as err:  # offline misses, auth and network errors all land here
        raise ArtifactError(
            f"cannot get hqekv artifacts from the Hub repo {repo_id!r}: {type(err).__name__}: {err}. "
            "With HF_HUB_OFFLINE=1 only the local Hub cache is read."
        ) from err


def find_artifact(
    source: str | Path, fingerprint: str, bavg: float | None, settings: dict, default_bavg: float | None = None
) -> Artifact:
    """The artifact for this model, bavg and settings in ``source``: a file, a directory or a Hub repo id.

    ``bavg=None`` takes the file's bavg, or a directory's only artifact that fits the model
    and settings; among several, the one at ``default_bavg`` (an error names the choices
    when there is none).
    """
    if not str(source).strip():
        raise ArtifactError("artifact is an empty path: give a file, a directory or a Hub repo id (owner/name)")
    path = Path(source).expanduser()
    if path.is_file():
        artifact = load_artifact(path)
        check_artifact(artifact, fingerprint, bavg, settings)
        return artifact
    if path.is_dir():
        directory = path
    elif isinstance(source, str) and _HUB_ID.match(source) and not source.endswith(SUFFIX):
        directory = _hub_snapshot(source)
    else:
        raise ArtifactError(f"artifact {str(source)!r}: no such file or directory, and not a Hub repo id (owner/name)")
    candidates = _directory_artifacts(directory)
    if not candidates:
        raise ArtifactError(f"no readable {SUFFIX} artifacts in {source}")
    if bavg is None:
        fitting = [a for a in candidates if _first_fitting([a], fingerprint, a.bavg, settings) is not None]
        if len(fitting) == 1:
            return fitting[0]
        at_default = [a for a in fitting if default_bavg is not None and abs(a.bavg - default_bavg) < 1e-6]
        if at_default:
            return at_default[0]
        if len(fitting) > 1:
            choices = ", ".join(sorted({f"{a.bavg:g}" for a in fitting}, key=float))
            raise ArtifactError(f"{source} holds artifacts for this model at bavg {choices}: pass bavg= to choose one")
    else:
        found = _first_fitting(candidates, fingerprint, bavg, settings)
        if found is not None:
            return found
    available = ", ".join(f"{a.metadata['model_id']} bavg={a.bavg:g}" for a in candidates)
    wanted = "" if bavg is None else f" at bavg={bavg:g}"
    raise ArtifactError(f"no artifact in {source} fits this model{wanted} with these settings; it has: {available}")


HUB_SUFFIX = "-hqekv"
"""The naming convention of artifact repos on the Hub: the artifacts of model ``owner/name``
live in the repo ``owner/name-hqekv`` (:func:`hub_repo`)."""


def hub_repo(model_id: str) -> str | None:
    """The Hub repo where, by convention, the artifacts of Hub model ``model_id`` live
    (``owner/name`` -> ``owner/name-hqekv``); None when ``model_id`` is not a Hub id."""
    model_id = str(model_id or "")
    if not _HUB_ID.match(model_id) or Path(model_id).expanduser().exists():
        return None
    return model_id + HUB_SUFFIX


def hub_cached(repo_id: str) -> Path | None:
    """The local Hub cache's snapshot of ``repo_id``, never the network; None if there is none."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=[f"*{SUFFIX}", "*.json"], local_files_only=True))
    except Exception:  # not downloaded (or no huggingface_hub): nothing cached to find
        return None


def find_own(model_id: str, fingerprint: str, bavg: float, settings: dict) -> Artifact | None:
    """An artifact for this model, bavg and settings that ``patch_model`` finds by itself,
    without the network, before the shipped ones: first among those ``hqekv calibrate``
    wrote to ``$HQEKV_CACHE/artifacts`` (:func:`hqekv.user_cache.artifacts_dir`), then in
    the local Hub cache's copy of the model's conventional repo (:func:`hub_repo`: present
    once ``artifact="owner/name-hqekv"`` has downloaded it)."""
    from .user_cache import artifacts_dir

    directories = [artifacts_dir()]
    repo = hub_repo(model_id)
    if repo is not None:
        directories.append(hub_cached(repo))
    for directory in directories:
        if directory is not None and directory.is_dir():
            found = _first_fitting(_directory_artifacts(directory), fingerprint, bavg, settings)
            if found is not None:
                return found
    return None


def shipped_artifacts() -> list[Path]:
    """Artifacts inside the installed package (not the layer profiles shipped beside them)."""
    return sorted(p for p in SHIPPED_DIR.glob(f"*{SUFFIX}") if not p.name.endswith(PROFILE_SUFFIX))


def find_shipped(fingerprint: str, bavg: float, settings: dict) -> Artifact | None:
    """The shipped artifact for this model, bavg and settings, if there is one."""
    return _first_fitting([load_artifact(p) for p in shipped_artifacts()], fingerprint, bavg, settings)


def sibling(artifact_path: Path, ending: str) -> Path:
    """A file next to an artifact: ``name-bavg2.safetensors`` -> ``name-bavg2<ending>``."""
    return artifact_path.with_name(artifact_path.name[: -len(SUFFIX)] + ending)


def report_path(artifact_path: Path) -> Path:
    return sibling(artifact_path, ".report.json")


def write_report(result) -> Path:
    """The calibration report (JSON) next to the artifact, and a plot of the history if matplotlib is there."""
    path = report_path(result.path)
    path.write_text(json.dumps(result.report(), indent=1) + "\n")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return path
    plot_history(result.history, sibling(result.path, ".history.png"), title=result.path.name,
                 kl_scale=result.metadata.get("kl_scale", "linear"))  # fmt: skip
    return path


def plot_history(history: list[dict], path: Path, title: str = "", kl_scale: str = "log") -> Path:
    """Objective per completed trial and the best so far (the Optuna history) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [h for h in history if h["state"] == "COMPLETE"]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    x = [h["number"] for h in done]
    y = [h["loss"] for h in done]
    best, running = [], float("inf")
    for v in y:
        running = min(running, v)
        best.append(running)
    ax.scatter(x, y, s=8, alpha=0.6, label=f"trial objective ({'ln KL' if kl_scale == 'log' else 'KL'} + α·δ3 + β·δ4)")
    ax.plot(x, best, color="C3", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel("objective")
    if kl_scale != "log":  # a log-KL objective may be negative
        ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def model_card(artifacts: Iterable[Artifact], repo_id: str, extra: Iterable[tuple[Path, str]] = ()) -> str:
    """README.md for a Hub repo of artifacts, listing each one's metadata (and each of the
    ``extra`` files with its line of description)."""
    lines = [
        "---",
        "library_name: hqekv",
        "tags: [hqekv, kv-cache, quantization]",
        "---",
        f"# {repo_id}",
        "",
        "HqeKV tier ratios calibrated with [hqekv](https://pypi.org/project/hqekv/). Use them with",
        "",
        "```python",
        "import hqekv",
        f'hqekv.patch_model(model, bavg=3.2, artifact="{repo_id}")',
        "```",
        "",
    ]
    for a in artifacts:
        lines += [f"## `{a.path.name}`", "", "| field | value |", "|---|---|"]
        lines.append(f"| ratios (fp16, δ1..δ4) | {', '.join(f'{r:.4f}' for r in a.ratios.as_tuple())} |")
        if a.key_ratios is not None:
            lines.append(f"| key ratios (fp16, δ1..δ4) | {', '.join(f'{r:.4f}' for r in a.key_ratios.as_tuple())} |")
        if a.layer_ratios is not None:
            lines.append(f"| per-layer budgets (bits) | {', '.join(f'{r.bavg:.2f}' for r in a.layer_ratios)} |")
        lines += [f"| {k} | {v} |" for k, v in sorted(a.metadata.items()) if k not in ("ratios", "key_ratios", "layer_ratios")]
        lines.append("")
    for path, description in extra:
        lines += [f"## `{Path(path).name}`", "", description, ""]
    return "\n".join(lines)


def push_artifacts(paths: Iterable[Path | str], repo_id: str, *, token: str | None = None, private: bool = False,
                   extra: Iterable[tuple[Path, str]] = ()) -> str:  # fmt: skip
    """Upload artifacts (and their reports) to a Hub model repo, created if needed, with a
    model card; ``extra``: more files (a layer profile) to upload, each with its line for the card."""
    from huggingface_hub import HfApi

    artifacts = [load_artifact(p) for p in paths]
    extra = list(extra)
    if not artifacts and not extra:
        raise ArtifactError("nothing to push: give at least one artifact")
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", exist_ok=True, private=private)
    for a in artifacts:
        api.upload_file(path_or_fileobj=str(a.path), path_in_repo=a.path.name, repo_id=repo_id)
        report = report_path(a.path)
        if report.is_file():
            api.upload_file(path_or_fileobj=str(report), path_in_repo=report.name, repo_id=repo_id)
    for path, _ in extra:
        api.upload_file(path_or_fileobj=str(path), path_in_repo=Path(path).name, repo_id=repo_id)
    card = model_card(artifacts, repo_id, extra)
    api.upload_file(path_or_fileobj=card.encode(), path_in_repo="README.md", repo_id=repo_id)
    return f"https://huggingface.co/{repo_id}"

"""Which configuration a patched model runs with: the ratios from explicit shares, an
artifact (given, your own, or shipped) or the rate-distortion allocator, and the defaults
that depend on the model (its head dim, the value group)."""

from __future__ import annotations

import warnings

from .config import (
    DEFAULTS, FP16_RATIOS, MAX_BAVG, HqeKVConfig, TierRatios, budget_config, check_bavg, coerce_layer_bits, mean_bavg,
)  # fmt: skip

DEFAULT_BAVG = 3.2


class UncalibratedRatiosWarning(UserWarning):
    """No calibrated ratios exist for this model and bavg; the rate-distortion allocator is used."""


def check_causal_lm(model) -> None:
    from transformers import GenerationMixin, PreTrainedModel

    if not isinstance(model, PreTrainedModel) or not isinstance(model, GenerationMixin):
        raise TypeError(
            "patch_model needs a Hugging Face causal language model (e.g. from AutoModelForCausalLM), "
            f"got {type(model).__name__}"
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError(f"patch_model supports decoder-only causal LMs, got encoder-decoder {type(model).__name__}")


def resolve_config(model, bavg=None, ratios=None, artifact=None, key_ratios=None, layer_ratios=None, profile=True,
                   **settings) -> HqeKVConfig:  # fmt: skip
    """Ratios in order (SPEC §2): explicit ``ratios`` (and ``key_ratios`` or ``layer_ratios``); ``artifact`` (file,
    directory or Hub repo id); an artifact of the user's own, then one shipped in the package,
    for this model and bavg; else the rate-distortion allocator (``ratios="auto"``), with an
    :class:`UncalibratedRatiosWarning`.

    A shipped artifact the allocator beats (:data:`hqekv.artifacts.SUPERSEDED`) gives way to
    the allocator at the real bytes the artifact's shares spend (:func:`hqekv.allocation.ratio_bits`);
    where the artifact measured its layers' sensitivity (``layer_sensitivity``), each layer
    gets its own budget split from it (``layer_bits``, :data:`hqekv.allocation.LAYER_STRENGTH`).
    Elsewhere, wherever the allocator runs without ``layer_bits``, the model's layer profile
    (:func:`hqekv.profiles.find_profile`) splits its budget; ``profile=False``
    (``layer_bits="shared"``) keeps one budget the layers share. ``ratios="calibrated"``
    insists on an artifact (own or shipped, superseded or not) and raises
    :class:`hqekv.artifacts.ArtifactError` when there is none."""
    from . import allocation, artifacts

    if bavg is not None:
        bavg = check_bavg(bavg)
    if ratios is not None and artifact is not None:
        raise ValueError("pass either ratios= or artifact=, not both")
    if key_ratios is not None and ratios is None:
        raise ValueError("key_ratios= needs ratios= (the values' shares); an artifact carries its own key ratios")
    if layer_ratios is not None and ratios is None:
        raise ValueError("layer_ratios= needs ratios= (the shares they were split from); "
                         "an artifact carries its own layer ratios")  # fmt: skip
    calibrated = isinstance(ratios, str) and ratios == "calibrated"
    if isinstance(ratios, str):
        if ratios not in ("auto", "calibrated"):
            raise ValueError(
                "ratios must be tier shares, 'auto' (the rate-distortion allocator) or 'calibrated' (an artifact's "
                f"shares), got {ratios!r}"
            )
        if key_ratios is not None or layer_ratios is not None:
            what = "chooses tiers by itself" if ratios == "auto" else "takes an artifact's shares"
            raise ValueError(f"ratios={ratios!r} {what}: key_ratios= and layer_ratios= do not apply")
        if ratios == "auto":
            if settings.get("layer_bits") is not None:
                if bavg is None:  # the mean of the layers' own budgets
                    layer_bits = coerce_layer_bits(settings["layer_bits"])
                    bavg = sum(layer_bits) / len(layer_bits)
                return budget_config(bavg, **settings)
            bavg = DEFAULT_BAVG if bavg is None else bavg
            if not profile:
                return budget_config(bavg, source="rate-distortion, one budget the layers share", **settings)
            return _allocator(model, bavg, "rate-distortion", settings)
        ratios = None
    if ratios is not None:
        ratios = TierRatios.coerce(ratios)
        key_ratios = None if key_ratios is None else TierRatios.coerce(key_ratios)
        if bavg is None:
            bavg = mean_bavg(ratios, key_ratios)
        return HqeKVConfig(
            ratios=ratios, key_ratios=key_ratios, layer_ratios=layer_ratios, bavg=bavg, ratios_source="explicit",
            **settings,
        )
    fingerprint = artifacts.model_fingerprint(model)
    matched = {k: settings.get(k, DEFAULTS[k]) for k in artifacts.MATCHED_SETTINGS}
    if artifact is not None:
        found = artifacts.find_artifact(artifact, fingerprint, bavg, matched, default_bavg=DEFAULT_BAVG)
        return HqeKVConfig(
            ratios=found.ratios, key_ratios=found.key_ratios, layer_ratios=found.layer_ratios, bavg=found.bavg,
            ratios_source=f"artifact:{found.path}", **settings,
        )
    bavg = DEFAULT_BAVG if bavg is None else bavg
    name = getattr(model.config, "_name_or_path", "") or model.config.model_type
    own = artifacts.find_own(name, fingerprint, bavg, matched)
    if own is not None:
        return HqeKVConfig(
            ratios=own.ratios, key_ratios=own.key_ratios, layer_ratios=own.layer_ratios, bavg=bavg,
            ratios_source=f"artifact:{own.path}", **settings,
        )
    shipped = artifacts.find_shipped(fingerprint, bavg, matched)
    if shipped is not None:
        config = HqeKVConfig(
            ratios=shipped.ratios, key_ratios=shipped.key_ratios, layer_ratios=shipped.layer_ratios, bavg=bavg,
            ratios_source=f"shipped:{shipped.path.name}", **settings,
        )
        if calibrated or shipped.path.name not in artifacts.SUPERSEDED:
            return config
        bits = allocation.ratio_bits(config, head_dim_of(model), model.dtype)
        source = f"rate-distortion at the bytes of shipped:{shipped.path.name}"
        return _allocator(model, bits, source, settings, shipped.metadata.get("layer_sensitivity"))
    if calibrated:
        raise artifacts.ArtifactError(
            f"ratios='calibrated': no calibrated artifact for {name!r} at bavg={bavg:g} with these settings (looked "
            f"in {_looked_in(name)}); run `hqekv calibrate --model ...`, pass artifact=..., or use ratios='auto'"
        )
    if bavg >= MAX_BAVG:  # 16 bits: nothing to allocate, every chunk stays full precision
        return HqeKVConfig(ratios=FP16_RATIOS, bavg=bavg, ratios_source="full precision", **settings)
    config = _allocator(model, bavg, "rate-distortion", settings)
    if config.layer_bits is not None:  # a layer profile: measured for this model, nothing to warn of
        return config
    warnings.warn(
        f"hqekv: no calibrated ratios for {name!r} at bavg={bavg:g} (looked in {_looked_in(name)}); the rate-distortion "
        f"allocator chooses the tiers (ratios='auto': {bavg:g} real bits per element of chunk storage, metadata "
        "included), one budget its layers share. Run `hqekv calibrate --model ... --profile` (minutes: each layer "
        "then gets its own share of any budget) or `--bavg B` (a search for calibrated shares); patch_model finds "
        "what it writes by itself. Or pass artifact=... or ratios=... to use calibrated or fixed shares.",
        UncalibratedRatiosWarning,
        stacklevel=3,
    )
    return config


def _allocator(model, bavg: float, source: str, settings: dict, sensitivity=None) -> HqeKVConfig:
    """The rate-distortion allocator at ``bavg``: each layer at its own budget, split at
    :data:`hqekv.allocation.LAYER_STRENGTH` by ``sensitivity`` (a superseded artifact's
    ``layer_sensitivity``, the split its supersession was measured with) or else by the
    model's layer profile (:func:`hqekv.profiles.find_profile`); with neither, one budget
    the layers share."""
    from . import allocation, artifacts, profiles
    from .patches.base import sliding_windows

    if sensitivity is not None:
        source = f"{source}, split over its layers by their sensitivity"
    else:
        matched = {k: settings.get(k, DEFAULTS[k]) for k in artifacts.MATCHED_SETTINGS}
        name = getattr(model.config, "_name_or_path", "") or model.config.model_type
        fingerprint = artifacts.model_fingerprint(model)
        profile = profiles.find_profile(name, fingerprint, matched)
        if profile is None:
            return budget_config(bavg, source=source, **settings)
        # found for this architecture, so a count of layers other than its own is a defect, not a miss
        profiles.check_profile(profile, fingerprint, matched, sliding_windows(model.config.get_text_config()).count(None))
        sensitivity, source = profile.sensitivity, f"{source}, each layer at its own budget from the layer profile {profile.path}"
    layer_bits = allocation.split_budget(bavg, sensitivity, allocation.LAYER_STRENGTH)
    return budget_config(bavg, source=source, layer_bits=layer_bits, **settings)


def _looked_in(name: str) -> str:
    """Where :func:`resolve_config` looks for a model's artifacts by itself, in words."""
    from . import artifacts
    from .user_cache import artifacts_dir

    repo = artifacts.hub_repo(name)
    return f"{artifacts_dir()}, the shipped ones" + (f" and the local Hub cache of {repo}" if repo else "")


def head_dim_of(model) -> int:
    """The attention head dim of ``model``'s text config."""
    text_config = model.config.get_text_config()
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def default_value_group(head_dim: int) -> int:
    """64 channels per value group (capped at the head dim, as the cache caps it), or the
    largest power of two below it that divides ``head_dim``."""
    group = 64
    while head_dim % min(group, head_dim):
        group //= 2
    return group

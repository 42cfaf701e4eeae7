"""The user surface: :func:`patch_model` / :func:`unpatch_model` plug the HqeKV cache into a
Hugging Face causal LM; :func:`new_cache`, :func:`patch_config` and :func:`memory_report`.
Which ratios a model gets is :mod:`hqekv.resolve`; how the patched model plugs into
``generate`` and the decoder is :mod:`hqekv.transformers_internals`."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

from .cache import HqeKVCache
from .config import HqeKVConfig, TierRatios, coerce_layer_bits
from .memory import MemoryReport
from .patches import attention_classes, sliding_windows
from .resolve import (
    DEFAULT_BAVG,
    UncalibratedRatiosWarning,
    check_causal_lm,
    default_value_group,
    head_dim_of,
    resolve_config,
)
from .transformers_internals import RECORD, PatchRecord, cache_for, install, new_cache, output_cache

__all__ = [
    "DEFAULT_BAVG",
    "UncalibratedRatiosWarning",
    "cache_for",
    "is_patched",
    "memory_report",
    "new_cache",
    "output_cache",
    "patch_config",
    "patch_model",
    "resolve_config",
    "unpatch_model",
]


def patch_model(
    model,
    bavg: float | None = None,
    *,
    ratios: TierRatios | tuple | dict | str | None = None,
    key_ratios: TierRatios | tuple | dict | None = None,
    layer_ratios: Sequence[TierRatios | tuple | dict] | None = None,
    layer_bits: Sequence[float] | str | None = None,
    artifact: str | Path | None = None,
    chunk_size: int = 32,
    window: int = 20,
    rerank_interval: int = 32,
    protected_chunks: int = 2,
    eviction: str = "joint",
    value_group: int | None = None,
    metadata_dtype: str | None = None,
    fp_dtype: str | None = None,
    rotation: str | None = None,
    importance: str = "attention",
    chunked_prefill: str = "wait",
    head_tiers: bool = False,
):
    """Make ``model`` keep its KV cache with HqeKV, in place; returns ``model``.

    Parameters
    ----------
    model : transformers causal LM of a supported architecture (``hqekv.SUPPORTED_MODEL_TYPES``)
    bavg : float, default 3.2
        Average code bits per element, in (0, 16]. 3.2 is near-lossless in the paper, 2.0 aggressive.
    ratios : TierRatios, dict, (d4, d2, d1, d_evict), (fp16, d4, d2, d1, d_evict), "auto" or "calibrated", optional
        Tier shares; if given with ``bavg`` they must satisfy SPEC eq. (6). ``"auto"``: no
        shares and no calibration; every re-rank chooses each chunk's tiers within a budget
        of ``bavg`` *real* bits per element (codes and metadata) by their expected damage to
        attention (``allocation="rate-distortion"``, :mod:`hqekv.allocation`).
        ``"calibrated"``: an artifact of your own or a shipped one for this model and bavg,
        even one the allocator superseded; :class:`hqekv.artifacts.ArtifactError` if none.
    key_ratios : same types, optional
        The keys' own tier shares (``ratios`` are then the values'); same evicted share,
        and ``bavg`` is the mean of the two budgets.
    layer_ratios : sequence of the same types, optional
        Per-layer budgets, one set of shares per global attention layer, for keys and values
        (:class:`hqekv.HqeKVConfig`); needs ``ratios`` (the shares they were split from), and
        ``bavg`` is their mean. Artifacts of ``hqekv calibrate --per-layer`` carry them.
    layer_bits : sequence of float or "shared", optional
        With ``ratios="auto"``: each global attention layer's own budget in real bits per
        element, averaging ``bavg``; the layers then do not share one budget
        (:class:`hqekv.HqeKVConfig`). :func:`hqekv.allocation.split_budget` makes them from
        measured per-layer sensitivities. By default the allocator takes them from the
        model's layer profile where one is found (:mod:`hqekv.profiles`, ``hqekv calibrate
        --profile``), else the layers share one budget; ``"shared"`` insists on that.
    artifact : path or Hub repo id, optional
        Calibrated ratios (:mod:`hqekv.artifacts`): a ``.safetensors`` file, a directory or a
        Hub repo id holding one per bavg. With ``bavg`` None, a file's bavg is used, or a
        directory's only artifact for this model, or among several the one at 3.2. It must be
        for this model (config fingerprint), this bavg and these cache settings; unreadable
        files in a directory are skipped with a warning.

    Without ``ratios`` and ``artifact``, an artifact of your own for this model and bavg
    (``$HQEKV_CACHE/artifacts``, or the model's ``owner/name-hqekv`` Hub repo in the local
    Hub cache) or the one shipped in the package is used (where the allocator beats a shipped
    artifact, :data:`hqekv.artifacts.SUPERSEDED`, the allocator at the real bytes the
    artifact's shares spend, split over the layers by the sensitivity it measured, where it
    did); if there is none, the rate-distortion allocator (as
    ``ratios="auto"``), with an :class:`UncalibratedRatiosWarning` (at bavg 16, every chunk
    full precision).
    value_group : int, optional
        Channels per value quantization group; by default 64, or the largest power of two
        below it that divides the head dim (32 for head dim 96, 16 for 80).
    chunked_prefill : {"wait", "wait-4bit", "evict"}, default "wait"
        A prompt fed in pieces (``generate(prefill_chunk_size=...)``): "wait" evicts once the
        whole prompt is in (the quality of a one-shot prefill, about 6.75 bits per element
        held until then: keys at 8 bits, values at 4); "wait-4bit" holds the keys at 4 bits
        too (about 4.75 bits per element, the answers moving more); "evict" keeps the cache
        near its budget from the first piece on (the smallest peak memory, at a larger
        quality cost). See :class:`hqekv.HqeKVConfig`.
    head_tiers : bool, default False
        Each KV head's part of a chunk at a tier of its own, the budget shared by a layer's
        heads (:class:`hqekv.HqeKVConfig`).
    chunk_size, window, rerank_interval, protected_chunks, eviction, metadata_dtype, fp_dtype, rotation, importance
        See :class:`hqekv.HqeKVConfig`.

    After patching, ``generate``, ``model(...)`` and pipelines use a new :class:`HqeKVCache`
    per request. ``unpatch_model`` restores the model exactly.
    """
    check_causal_lm(model)
    if hasattr(model, RECORD):
        raise ValueError("model is already patched by hqekv; call hqekv.unpatch_model(model) first")
    text_config = model.config.get_text_config()
    classes = attention_classes(text_config)
    n_global = sliding_windows(text_config).count(None)
    if layer_ratios is not None and len(layer_ratios) != n_global:
        raise ValueError(
            f"{len(layer_ratios)} layer_ratios for a {text_config.model_type} model with {n_global} global attention "
            "layers: give one set of shares per global attention layer"
        )
    profile = True
    if isinstance(layer_bits, str):
        if layer_bits != "shared":
            raise ValueError(f"layer_bits must be one budget per global attention layer or 'shared', got {layer_bits!r}")
        if not (isinstance(ratios, str) and ratios == "auto"):
            raise ValueError("layer_bits='shared' is a choice of the rate-distortion allocator: pass ratios='auto' with it")
        profile, layer_bits = False, None
    if layer_bits is not None:
        if not (isinstance(ratios, str) and ratios == "auto"):
            raise ValueError("layer_bits= are budgets of the rate-distortion allocator: pass ratios='auto' with them")
        layer_bits = coerce_layer_bits(layer_bits)  # its type and entries; the mean is checked against bavg later
        if len(layer_bits) != n_global:
            raise ValueError(
                f"{len(layer_bits)} layer_bits for a {text_config.model_type} model with {n_global} global attention "
                "layers: give one budget per global attention layer"
            )
    head_dim = head_dim_of(model)
    if value_group is None:
        value_group = default_value_group(head_dim)
    config = resolve_config(
        model,
        bavg,
        ratios,
        artifact,
        key_ratios,
        layer_ratios,
        chunk_size=chunk_size,
        window=window,
        rerank_interval=rerank_interval,
        protected_chunks=protected_chunks,
        eviction=eviction,
        value_group=value_group,
        metadata_dtype=metadata_dtype,
        fp_dtype=fp_dtype,
        rotation=rotation,
        importance=importance,
        chunked_prefill=chunked_prefill,
        head_tiers=head_tiers,
        **({} if layer_bits is None else {"layer_bits": layer_bits}),
        **({} if profile else {"profile": False}),
    )
    if head_dim % min(config.value_group, head_dim):
        raise ValueError(
            f"head dim {head_dim} is not a multiple of value_group {config.value_group}; pass a value_group that "
            f"divides it (e.g. value_group={default_value_group(head_dim)}, or leave it out)"
        )

    if config.layer_ratios is not None and len(config.layer_ratios) != n_global:
        raise ValueError(
            f"{config.ratios_source} gives {len(config.layer_ratios)} per-layer budgets but this "
            f"{text_config.model_type} model has {n_global} global attention layers"
        )
    if not n_global:
        warnings.warn(
            f"hqekv: every attention layer of this {text_config.model_type} model slides over a "
            f"{text_config.sliding_window}-token window; hqekv keeps sliding windows exact, so it compresses nothing here",
            UserWarning,
            stacklevel=2,
        )
    record = PatchRecord(config)
    install(model, record, classes, text_config.model_type)
    setattr(model, RECORD, record)
    return model


def unpatch_model(model):
    """Undo :func:`patch_model`: the model behaves exactly as before. Returns ``model``."""
    record = getattr(model, RECORD, None)
    if record is None:
        raise ValueError("model is not patched by hqekv")
    record.restore()
    delattr(model, RECORD)
    return model


def is_patched(model) -> bool:
    return hasattr(model, RECORD)


def patch_config(model) -> HqeKVConfig:
    """The :class:`HqeKVConfig` a patched model runs with; ``ratios_source`` says where its ratios came from."""
    record = getattr(model, RECORD, None)
    if record is None:
        raise ValueError("model is not patched by hqekv")
    return record.config


def memory_report(model_or_cache) -> MemoryReport:
    """Real bytes of an HqeKV cache: of a cache, or of the last one a patched model used.

    Prefer the cache: ``generate(..., return_dict_in_generate=True)`` and ``model(...)`` return
    it (``out.cache``, or ``out.past_key_values`` before transformers 5.2x). Given a model,
    this reports the last request *of the calling thread* (the cache of a generate call in
    progress while it runs, then its final state), so two threads sharing one patched model
    each get their own; a thread that has run nothing gets a ``ValueError``.
    """
    if isinstance(model_or_cache, HqeKVCache):
        return model_or_cache.memory_report()
    record = getattr(model_or_cache, RECORD, None)
    if record is None:
        raise ValueError("memory_report needs an HqeKVCache or a model patched with hqekv.patch_model")
    cache = record.last_cache() if record.last_cache is not None else None
    if cache is not None:
        return cache.memory_report()
    if record.last_report is not None:
        return record.last_report
    raise ValueError("this patched model has not run with a cache yet: nothing to report")

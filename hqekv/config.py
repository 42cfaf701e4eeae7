"""Settings of an HqeKV cache: a validated, versioned dataclass (SPEC §1)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

CONFIG_VERSION = 1

EVICTION_CRITERIA = ("joint", "key", "value")
"""joint: evict chunks unimportant under both metrics (SPEC §1.3 fix); key / value: ablations."""

FP_DTYPES = (None, "model", "float16", "bfloat16", "float32")
"""Choices of HqeKVConfig.fp_dtype: None (16-bit whatever the model dtype), "model", or a dtype name."""

ROTATIONS = (None, "hadamard")
"""Choices of HqeKVConfig.rotation: None (the paper: no rotation) or "hadamard"."""

ALLOCATIONS = ("ratios", "rate-distortion")
"""ratios: the tier shares of ``HqeKVConfig.ratios`` (the paper); rate-distortion: each re-rank
chooses tiers within a byte budget (:mod:`hqekv.allocation`)."""

IMPORTANCE_KINDS = ("attention", "random")
"""attention: the paper's metrics (§3.2); random: the control that isolates them."""

CHUNKED_PREFILL = ("wait", "wait-4bit", "evict")
"""Choices of HqeKVConfig.chunked_prefill: wait (evict once the prompt is whole, the waiting
keys at 8 bits), wait-4bit (the same, keys at 4 bits) or evict (each piece within the budget
as it arrives)."""
DEFERRING = ("wait", "wait-4bit")
"""The choices of :data:`CHUNKED_PREFILL` under which a prompt's chunks wait for its end."""

MAX_BAVG = 16.0
RATIO_TOLERANCE = 1e-4


def check_bavg(bavg: Any) -> float:
    """Return ``bavg`` as a float in (0, 16], or raise ``ValueError``/``TypeError`` naming the problem."""
    if isinstance(bavg, bool) or not isinstance(bavg, (int, float)):
        raise TypeError(f"bavg must be a number of bits per element in (0, {MAX_BAVG:g}], got {bavg!r}")
    bavg = float(bavg)
    if math.isnan(bavg) or math.isinf(bavg):
        raise ValueError(f"bavg must be finite, got {bavg!r}")
    if not 0.0 < bavg <= MAX_BAVG:
        raise ValueError(f"bavg must be in (0, {MAX_BAVG:g}] bits per element, got {bavg:g}")
    return bavg


@dataclass(frozen=True)
class TierRatios:
    """Shares of chunks per tier (SPEC §1.3); they sum to 1.

    ``int4``, ``int2``, ``int1``, ``evict`` are the paper's δ1..δ4. ``fp16`` is an extra
    full-precision share (0 in the paper), so that bavg in (4, 16] and the all-FP16
    identity setting can be expressed. The top chunks and the tail are FP16 on top of these.
    """

    fp16: float = 0.0
    int4: float = 0.0
    int2: float = 0.0
    int1: float = 0.0
    evict: float = 0.0

    def __post_init__(self):
        values = self.as_tuple()
        for name, value in zip(self.names(), values):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"ratio {name} must be a finite number, got {value!r}")
            if value < -RATIO_TOLERANCE or value > 1 + RATIO_TOLERANCE:
                raise ValueError(f"ratio {name} must be in [0, 1], got {value:g}")
        total = sum(values)
        if abs(total - 1.0) > RATIO_TOLERANCE:
            raise ValueError(f"tier ratios must sum to 1, got {total:g} ({self.describe()})")

    @staticmethod
    def names() -> tuple[str, ...]:
        return ("fp16", "int4", "int2", "int1", "evict")

    def as_tuple(self) -> tuple[float, float, float, float, float]:
        return (self.fp16, self.int4, self.int2, self.int1, self.evict)

    @property
    def bavg(self) -> float:
        """Average code bits per element these ratios give (SPEC eq. 6, FP16 counting 16)."""
        return 16 * self.fp16 + 4 * self.int4 + 2 * self.int2 + self.int1

    def describe(self) -> str:
        return ", ".join(f"{n}={v:.4g}" for n, v in zip(self.names(), self.as_tuple()))

    @classmethod
    def coerce(cls, ratios: "TierRatios | Sequence[float] | dict") -> "TierRatios":
        """Accept a TierRatios, a dict, ``(d4, d2, d1, d_evict)`` (paper order) or
        ``(fp16, d4, d2, d1, d_evict)``."""
        if isinstance(ratios, cls):
            return ratios
        if isinstance(ratios, dict):
            unknown = set(ratios) - set(cls.names())
            if unknown:
                raise ValueError(f"unknown tier names {sorted(unknown)}; expected some of {cls.names()}")
            return cls(**{k: float(v) for k, v in ratios.items()})
        if isinstance(ratios, torch.Tensor):
            ratios = ratios.tolist()
        if isinstance(ratios, (list, tuple)):
            if len(ratios) == 4:
                return cls(0.0, *(float(r) for r in ratios))
            if len(ratios) == 5:
                return cls(*(float(r) for r in ratios))
            raise ValueError(
                f"ratios must have 4 entries (d4, d2, d1, d_evict) or 5 (fp16, d4, d2, d1, d_evict), got {len(ratios)}"
            )
        raise TypeError(f"ratios must be a TierRatios, dict or sequence of floats, got {type(ratios).__name__}")


def mean_bavg(ratios: TierRatios, key_ratios: TierRatios | None = None) -> float:
    """Average code bits per element of values at ``ratios`` and keys at ``key_ratios`` (default: the same)."""
    return ratios.bavg if key_ratios is None else (ratios.bavg + key_ratios.bavg) / 2


def coerce_layer_ratios(layer_ratios) -> tuple[TierRatios, ...]:
    """``layer_ratios`` as a tuple of :class:`TierRatios` (one per compressed layer), or raise."""
    if isinstance(layer_ratios, (TierRatios, str, dict)) or not isinstance(layer_ratios, (list, tuple)):
        raise TypeError(f"layer_ratios must be a sequence of tier ratios, one per compressed layer, got {layer_ratios!r}")
    if not layer_ratios:
        raise ValueError("layer_ratios is empty: give one set of tier ratios per compressed layer, or None")
    return tuple(TierRatios.coerce(r) for r in layer_ratios)


def coerce_layer_bits(layer_bits, bavg: float | None = None) -> tuple[float, ...]:
    """``layer_bits`` as a tuple of budgets, each one a valid bavg, averaging ``bavg`` when
    it is given, or raise."""
    if isinstance(layer_bits, (str, bytes)) or not isinstance(layer_bits, (list, tuple)):
        raise TypeError(f"layer_bits must be a sequence of bits per element, one per compressed layer, got {layer_bits!r}")
    if not layer_bits:
        raise ValueError("layer_bits is empty: give one budget per compressed layer, or None")
    bits = []
    for i, b in enumerate(layer_bits):
        try:
            bits.append(check_bavg(b))
        except (TypeError, ValueError) as error:
            raise type(error)(f"layer_bits[{i}]: {error}") from None
    bits = tuple(bits)
    mean = sum(bits) / len(bits)
    if bavg is not None and abs(mean - bavg) > 1e-3:
        raise ValueError(f"layer_bits average {mean:.4g} bits per element over their {len(bits)} layers, but bavg={bavg:g}")
    return bits


def layer_mean_bavg(layer_ratios: Sequence[TierRatios]) -> float:
    """Average code bits per element over layers of equal size."""
    return sum(r.bavg for r in layer_ratios) / len(layer_ratios)


def check_one_evicted_set(ratios: TierRatios, key_ratios: TierRatios | None) -> None:
    """Raise ``ValueError`` unless keys and values evict the same share: a chunk leaves whole."""
    if key_ratios is not None and abs(key_ratios.evict - ratios.evict) > RATIO_TOLERANCE:
        raise ValueError(
            f"key ratios evict {key_ratios.evict:.4g} of the chunks but value ratios {ratios.evict:.4g}: "
            "a chunk is evicted with its key and its value, so the evicted shares must be equal"
        )


def describe_ratios(ratios: TierRatios, key_ratios: TierRatios | None = None) -> str:
    """``ratios.describe()``, or both sets when keys have their own."""
    if key_ratios is None:
        return ratios.describe()
    return f"keys {key_ratios.describe()}; values {ratios.describe()}"


FP16_RATIOS = TierRatios(fp16=1.0)
"""Everything full precision: the cache must then reproduce the unpatched model."""


def budget_config(bavg: float, source: str = "rate-distortion", **settings) -> "HqeKVConfig":
    """The rate-distortion allocator at ``bavg`` real bits per element of chunk storage;
    ``source`` says why (its ``ratios_source``)."""
    return HqeKVConfig(
        ratios=uncalibrated_ratios(bavg), bavg=bavg, allocation="rate-distortion", ratios_source=source, **settings
    )


def uncalibrated_ratios(bavg: float) -> TierRatios:
    """Fixed shares that reach ``bavg`` without calibration (the fallback before the
    rate-distortion allocator took its place; still used to size a static cache's first
    reserve under ``allocation="rate-distortion"``).

    Uses the fewest tiers that reach ``bavg`` exactly, preferring quantization over
    eviction: (4, 16] FP16 + 4-bit; [2, 4] 4-bit + 2-bit; [1, 2) 2-bit + 1-bit;
    (0, 1) 1-bit + eviction.
    """
    bavg = check_bavg(bavg)
    if bavg > 4:
        fp16 = (bavg - 4) / 12
        return TierRatios(fp16=fp16, int4=1 - fp16)
    if bavg >= 2:
        return TierRatios(int4=(bavg - 2) / 2, int2=(4 - bavg) / 2)
    if bavg >= 1:
        return TierRatios(int2=bavg - 1, int1=2 - bavg)
    return TierRatios(int1=bavg, evict=1 - bavg)


@dataclass(frozen=True)
class HqeKVConfig:
    """How an HqeKV cache compresses (SPEC §1).

    Parameters
    ----------
    ratios : TierRatios
        Shares of chunks per tier: of the values, and of the keys unless ``key_ratios``.
    bavg : float
        Target average code bits per element: ``ratios.bavg``, or the mean of the key and
        value budgets with ``key_ratios``.
    key_ratios : TierRatios, optional
        Shares of the key tiers when keys get another budget than values (keys are the
        more sensitive half). A chunk is evicted as a whole, so the evicted share must equal
        ``ratios.evict``. None: keys and values share ``ratios`` (the paper).
    chunk_size : int, default 32
        G, tokens per chunk; also the FP16 tail capacity.
    window : int, default 20
        m, number of most recent queries whose attention scores importance.
    rerank_interval : int, default 32
        T, generated tokens between re-rankings; a multiple of ``chunk_size``.
    protected_chunks : int, default 2
        Chunks kept in FP16 per metric on top of the ratios, never evicted.
    eviction : {"joint", "key", "value"}, default "joint"
        Which metric decides eviction (SPEC §1.3 fix; "key"/"value" are ablations).
    value_group : int, default 64
        Channels per value quantization group (capped at the head dim). 64 halves the
        values' metadata of 32 (0.5 instead of 1 bit per element) for about 10% more KL at
        4 bits; 32 for head dims that 64 does not divide.
    metadata_dtype : str or None
        dtype of scale/zero and std/mean; None: bfloat16 for bf16 models, else float16.
    fp_dtype : str or None
        dtype of the full-precision parts (FP16 chunks, the tail, the window queries).
        None: the model dtype when it is 16-bit, else float16, so that a full-precision
        element costs 16 bits whatever the model dtype (SPEC §1.1); "model" keeps the
        model dtype (an fp32 model's FP16 tier then reproduces the unpatched model bit for
        bit); or "float16", "bfloat16", "float32".
    rotation : {None, "hadamard"}, default None
        None is the paper's setting: keys are quantized per channel as they come, after
        RoPE. "hadamard" is an orthogonal basis change of every head's keys, queries and
        values before they are cached: a normalized Hadamard matrix (block-diagonal over
        the largest power of two that divides the head dim). Scores q·k are unchanged (up
        to the rounding of the rotated vectors to the model dtype), and the attention output
        is rotated back, so only the quantization error changes. It is an option, not the
        default: it lowers the loss of uniform 2-bit keys on SmolLM2 but ties with the
        calibrated ratios there, and it raises perplexity on Gemma-3-270M and
        Qwen2.5-Coder-0.5B, whose per-channel key groups lose their outlier channels' own
        ranges when the rotation spreads them (``docs/results.md``, ablation). With None,
        ``fp_dtype="model"`` and all-FP16 ratios, the cache reproduces the unpatched model
        bit for bit.
    importance : {"attention", "random"}, default "attention"
        What ranks the chunks: the paper's window-attention metrics, or "random", a control
        that keeps the tier counts and assigns chunks at random (a fixed hash of layer and
        chunk, the same at every re-rank), to measure what the importance metric buys.
    layer_ratios : sequence of TierRatios, optional
        Per-layer budgets: one set of tier shares per compressed (global attention) layer,
        in layer order, for keys and values alike; their bavg averages to ``bavg``.
        ``ratios`` are then the shares the split started from (the searched one-for-all
        ratios, :func:`hqekv.calibration.layer_budgets`). None: every layer uses ``ratios``
        (the paper). Not combinable with ``key_ratios``.
    allocation : {"ratios", "rate-distortion"}, default "ratios"
        "ratios": every re-rank gives each tier its share of the chunks (the paper, with
        calibrated or given ratios). "rate-distortion": no shares; every re-rank chooses each
        chunk's key and value tier, or its eviction, so that the chunks' real bytes (codes
        and metadata) stay within ``bavg`` bits per element of the tokens seen and the
        expected error of the window queries' attention outputs is smallest
        (:mod:`hqekv.allocation`). ``bavg`` then counts real bits, metadata included, and
        ``ratios`` only size a static cache's first reserve. ``patch_model(ratios="auto")``.
    layer_bits : sequence of float, optional
        Under ``allocation="rate-distortion"``: each compressed (global attention) layer's
        own budget in real bits per element, in layer order, averaging ``bavg``; each layer
        then chooses within its own budget and the layers do not share one. A calibration
        splits the budget so from each layer's measured sensitivity
        (:func:`hqekv.allocation.split_budget`). None: the layers share ``bavg``, one price
        of a byte for the whole model (:func:`hqekv.allocation.share`).
    head_tiers : bool, default False
        Each KV head's part of a chunk takes a tier of its own, ranked by the importance its
        own query heads give it. Under fixed ratios each head keeps its shares, evicting
        apart; under the allocator one budget serves all heads of a layer (or of the model),
        so bytes move to the heads where they lower the error most, and a chunk is evicted
        for all its heads or for none (:data:`hqekv.allocation.HEAD_EVICTION`). The layer
        stores each head as a row of its own: its chunk tables hold an entry per chunk and
        head (real bytes, counted). Off by default: on held-out text its KL was within the
        spread of one tier per chunk's, its perplexity loss lower (``docs/results.md``,
        "Tiers per KV head"). False: a
        chunk's tier holds for all its KV heads (the paper). A model with one KV head is the
        same either way.
    chunked_prefill : {"wait", "wait-4bit", "evict"}, default "wait"
        What the cache does while a prompt arrives in pieces (``generate(prefill_chunk_size=...)``,
        or :meth:`~hqekv.cache.HqeKVCache.defer_eviction` in a loop of one's own). "wait":
        evict nothing and hold every chunk at the 4-bit tier, its keys at 8 bits (FP16 where
        the ratios or the allocator keep it) until the prompt's end, then place every tier
        within the budget with the prompt's last queries: a chunked prompt ends as a one-shot
        one would, and the peak holds about 6.75 bits per element of the prompt (8-bit keys,
        4-bit values and their metadata). "wait-4bit": the same with the keys at 4 bits,
        about 4.75 bits per element held, where the pieces read more error and a chunked
        prompt's answers move further from one-shot's. "evict":
        every piece is ranked and evicted within the budget as it arrives, so the cache stays
        near its budget throughout: the smallest peak, at a quality cost, since an early
        piece is ranked before the question at the prompt's end is seen
        (``docs/results.md``, "Long prompts").
    ratios_source : str
        Where the ratios came from: "explicit", "artifact:<path>", "shipped:<file>",
        "rate-distortion", "rate-distortion at the bytes of shipped:<file>" (an artifact the
        allocator superseded), "full precision".
    """

    ratios: TierRatios
    bavg: float
    chunk_size: int = 32
    window: int = 20
    rerank_interval: int = 32
    protected_chunks: int = 2
    eviction: str = "joint"
    value_group: int = 64
    metadata_dtype: str | None = None
    fp_dtype: str | None = None
    rotation: str | None = None
    importance: str = "attention"
    key_ratios: TierRatios | None = None
    layer_ratios: tuple[TierRatios, ...] | None = None
    allocation: str = "ratios"
    layer_bits: tuple[float, ...] | None = None
    head_tiers: bool = False
    chunked_prefill: str = "wait"
    ratios_source: str = "explicit"
    version: int = field(default=CONFIG_VERSION)

    def __post_init__(self):
        if not isinstance(self.ratios, TierRatios):
            object.__setattr__(self, "ratios", TierRatios.coerce(self.ratios))
        if self.key_ratios is not None and not isinstance(self.key_ratios, TierRatios):
            object.__setattr__(self, "key_ratios", TierRatios.coerce(self.key_ratios))
        object.__setattr__(self, "bavg", check_bavg(self.bavg))
        check_one_evicted_set(self.ratios, self.key_ratios)
        if self.layer_ratios is not None:
            object.__setattr__(self, "layer_ratios", coerce_layer_ratios(self.layer_ratios))
            if self.key_ratios is not None:
                raise ValueError("layer_ratios and key_ratios cannot be combined: per-layer budgets hold for keys and values alike")
            mean = layer_mean_bavg(self.layer_ratios)
            if abs(mean - self.bavg) > 1e-3:
                raise ValueError(f"layer_ratios average {mean:.4g} bits per element over their "
                                 f"{len(self.layer_ratios)} layers, but bavg={self.bavg:g}")  # fmt: skip
        if abs(self.code_bavg - self.bavg) > 1e-3:
            what = f"ratios ({self.ratios.describe()})"
            if self.key_ratios is not None:
                what = f"keys ({self.key_ratios.describe()}) and values ({self.ratios.describe()}) on average"
            raise ValueError(
                f"{what} give {self.code_bavg:.4g} bits per element (SPEC eq. 6: "
                f"16·fp16 + 4·d4 + 2·d2 + d1) but bavg={self.bavg:g}"
            )
        for name in ("chunk_size", "window", "rerank_interval", "value_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.protected_chunks, bool) or not isinstance(self.protected_chunks, int) or self.protected_chunks < 0:
            raise ValueError(f"protected_chunks must be a non-negative integer, got {self.protected_chunks!r}")
        if self.chunk_size % 32 and 32 % self.chunk_size:
            raise ValueError(f"chunk_size must divide or be a multiple of 32, got {self.chunk_size}")
        if self.rerank_interval % self.chunk_size:
            raise ValueError(
                f"rerank_interval ({self.rerank_interval}) must be a multiple of chunk_size ({self.chunk_size})"
            )
        if self.eviction not in EVICTION_CRITERIA:
            raise ValueError(f"eviction must be one of {EVICTION_CRITERIA}, got {self.eviction!r}")
        if self.metadata_dtype not in (None, "float16", "bfloat16", "float32"):
            raise ValueError(f"metadata_dtype must be None, 'float16', 'bfloat16' or 'float32', got {self.metadata_dtype!r}")
        if self.importance not in IMPORTANCE_KINDS:
            raise ValueError(f"importance must be one of {IMPORTANCE_KINDS}, got {self.importance!r}")
        if self.chunked_prefill not in CHUNKED_PREFILL:
            raise ValueError(f"chunked_prefill must be one of {CHUNKED_PREFILL}, got {self.chunked_prefill!r}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {self.allocation!r}")
        if self.allocation == "rate-distortion":
            for name, fixed in (("key_ratios", self.key_ratios), ("layer_ratios", self.layer_ratios)):
                if fixed is not None:
                    raise ValueError(f"{name} fix tier shares; allocation='rate-distortion' chooses tiers by itself")
            if self.importance != "attention":
                raise ValueError("allocation='rate-distortion' weighs errors by attention; importance must be 'attention'")
        if self.layer_bits is not None:
            if self.allocation != "rate-distortion":
                raise ValueError("layer_bits are per-layer budgets of the rate-distortion allocator; "
                                 "with allocation='ratios' give layer_ratios")  # fmt: skip
            object.__setattr__(self, "layer_bits", coerce_layer_bits(self.layer_bits, self.bavg))
        if not isinstance(self.head_tiers, bool):
            raise ValueError(f"head_tiers must be True or False, got {self.head_tiers!r}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {ROTATIONS}, got {self.rotation!r}")
        if self.fp_dtype not in FP_DTYPES:
            raise ValueError(f"fp_dtype must be one of {FP_DTYPES}, got {self.fp_dtype!r}")

    @property
    def k_ratios(self) -> TierRatios:
        """Tier shares of the keys."""
        return self.ratios if self.key_ratios is None else self.key_ratios

    @property
    def code_bavg(self) -> float:
        """Average code bits per element the ratios give, keys and values together."""
        return mean_bavg(self.ratios, self.key_ratios)

    def describe_ratios(self) -> str:
        if self.layer_bits is not None:
            bits = ", ".join(f"{b:.2f}" for b in self.layer_bits)
            return f"rate-distortion, {len(self.layer_bits)} per-layer budgets (bits {bits})"
        if self.layer_ratios is not None:
            bits = ", ".join(f"{r.bavg:.2f}" for r in self.layer_ratios)
            return f"{len(self.layer_ratios)} per-layer budgets (bits {bits}) from {self.ratios.describe()}"
        return describe_ratios(self.ratios, self.key_ratios)

    def for_layer(self, index: int) -> "HqeKVConfig":
        """The settings of compressed layer ``index`` (counting global attention layers only):
        this config, with that layer's ratios when ``layer_ratios`` is set, or its budget
        when ``layer_bits`` is."""
        if self.layer_bits is not None:
            bits = self.layer_bits[index]
            return dataclasses.replace(self, ratios=uncalibrated_ratios(bits), bavg=bits, layer_bits=None)
        if self.layer_ratios is None:
            return self
        r = self.layer_ratios[index]
        return dataclasses.replace(self, ratios=r, bavg=r.bavg, layer_ratios=None)

    def resolve_metadata_dtype(self, kv_dtype: torch.dtype) -> torch.dtype:
        if self.metadata_dtype is not None:
            return getattr(torch, self.metadata_dtype)
        return torch.bfloat16 if kv_dtype == torch.bfloat16 else torch.float16

    def resolve_fp_dtype(self, kv_dtype: torch.dtype) -> torch.dtype:
        """dtype the full-precision parts are stored in for a model whose K/V are ``kv_dtype``."""
        if self.fp_dtype == "model":
            return kv_dtype
        if self.fp_dtype is not None:
            return getattr(torch, self.fp_dtype)
        return kv_dtype if kv_dtype in (torch.float16, torch.bfloat16) else torch.float16

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ratios"] = dict(zip(TierRatios.names(), self.ratios.as_tuple()))
        if self.key_ratios is not None:
            d["key_ratios"] = dict(zip(TierRatios.names(), self.key_ratios.as_tuple()))
        if self.layer_ratios is not None:
            d["layer_ratios"] = [dict(zip(TierRatios.names(), r.as_tuple())) for r in self.layer_ratios]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "HqeKVConfig":
        d = dict(d)
        version = d.pop("version", CONFIG_VERSION)
        if version != CONFIG_VERSION:
            raise ValueError(f"unsupported HqeKVConfig version {version}; this library reads version {CONFIG_VERSION}")
        d["ratios"] = TierRatios.coerce(d["ratios"])
        if d.get("key_ratios") is not None:
            d["key_ratios"] = TierRatios.coerce(d["key_ratios"])
        if d.get("layer_ratios") is not None:
            d["layer_ratios"] = coerce_layer_ratios(d["layer_ratios"])
        if d.get("layer_bits") is not None:
            d["layer_bits"] = tuple(d["layer_bits"])
        return cls(**d)


RATIO_FIELDS = ("ratios", "bavg", "key_ratios", "layer_ratios", "allocation", "layer_bits", "head_tiers")
"""HqeKVConfig fields that say how many bits go where: what a calibration finds."""
RUNTIME_FIELDS = ("importance", "chunked_prefill", "ratios_source", "version")
"""HqeKVConfig fields that are neither ratios nor a setting a calibration is made for."""
CACHE_SETTINGS = tuple(f.name for f in dataclasses.fields(HqeKVConfig) if f.name not in RATIO_FIELDS + RUNTIME_FIELDS)
"""Every other field: how the cache stores what the ratios assign (chunk size, window, ...)."""
DEFAULTS = {f.name: f.default for f in dataclasses.fields(HqeKVConfig) if f.name in CACHE_SETTINGS + RUNTIME_FIELDS}

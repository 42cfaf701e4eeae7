"""KV-cache methods compared by the evaluation, all through the same cache machinery.

- ``fp16``: the unpatched model and its own dense cache (in the model dtype).
- ``kivi:B``: every chunk uniform B-bit (B in 2, 4; 1 is the normalized 1-bit tier), keys
  per channel and values per token as in KIVI, the newest ``len % 32`` tokens kept as an
  FP16 residual; no FP16 chunks on top, no rotation. ``rkivi:B``: the same, rotated
  (``rotation="hadamard"``): what the rotation does to a tier by itself.
- ``evict:B``: eviction only. Chunks are kept in full precision (16 bits) or evicted,
  ranked by the window queries' attention (SnapKV/H2O-style, ``eviction="key"``); the kept
  share is ``(B + METADATA_BITS) / 16``, what ``kivi:B`` costs with its 16-bit scale and
  zero per group.
- ``hqekv:B``: ``patch_model(model, B)``: calibrated ratios when an artifact fits, the
  rate-distortion allocator at the artifact's real bytes where it superseded a shipped
  artifact, else the allocator at B real bits (the result records which).
- ``calibrated:B``: ``patch_model(model, B, ratios="calibrated")``: the calibrated
  artifact, even where the allocator superseded it.
- ``paper:B``: the paper's setting: the calibrated ratios of ``calibrated:B`` as one set for
  every layer (without an artifact's per-layer budgets), no rotation; ``rpaper:B`` the same,
  rotated. ``rhqekv:B``: ``hqekv:B`` with the Hadamard
  rotation (the default until it lost on Qwen2.5 and Gemma3; the ablation of
  ``docs/results.md``, ``benchmarks/ablation.py``, adds the other variants).
- ``random:B``: the control of the importance metric: the tier counts of ``calibrated:B``
  (same ratios, same protected chunks), chunks assigned at random
  (``importance="random"``).
- ``auto:B``: ``patch_model(model, B, ratios="auto")``: no ratios; every re-rank chooses
  tiers within B *real* bits per element of chunk storage (codes and metadata) by their
  expected damage to attention (:mod:`hqekv.allocation`), each layer at its own share of B
  where the model's layer profile is found (:mod:`hqekv.profiles`).
- ``shared:B``: ``patch_model(model, B, ratios="auto", layer_bits="shared")``: the allocator
  with one budget its layers share, even where a layer profile would split it (the
  allocator before layer profiles; the baseline they are measured against).
- ``heads:B``: ``auto:B`` with ``head_tiers=True``: each KV head's part of a chunk at a
  tier of its own, one budget for a layer's heads.
- ``fallback:B``: the fixed shares of :func:`hqekv.uncalibrated_ratios` (what a model
  without an artifact got before the allocator), even where an artifact exists.
- ``quanto:B`` (B in 2, 4): the external anchor, transformers' ``QuantizedCache`` with
  the optimum-quanto backend at its defaults (groups of 64, a 128-token residual in the
  model dtype), on the unpatched model (``pip install optimum-quanto``).

Every result also records the *measured* bytes and effective bits, which is what the
plots compare on.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass

from ..config import TierRatios, check_bavg, uncalibrated_ratios

KINDS = (
    "fp16", "kivi", "rkivi", "evict", "hqekv", "rhqekv", "calibrated", "random", "quanto", "paper", "rpaper", "auto",
    "shared", "heads", "fallback",
)  # fmt: skip
ONE_SET = ("paper", "rpaper")
"""Kinds that use the calibrated ratios as one set for every layer, without per-layer budgets."""
KIVI_BITS = {4: "int4", 2: "int2", 1: "int1"}
QUANTO_BITS = (2, 4)
METADATA_BITS = 0.75
"""Real bits per element a uniform tier adds: a 16-bit scale + zero per key group of 32 tokens
(1 bit) and per value group of 64 channels (0.5 bit)."""


@dataclass(frozen=True)
class Method:
    """One KV-cache method at one bit-width: ``kind`` in KINDS, ``bits`` None for fp16."""

    kind: str
    bits: float | None = None

    @property
    def name(self) -> str:
        return self.kind if self.bits is None else f"{self.kind}:{self.bits:g}"

    def patch_kwargs(self) -> dict | None:
        """Arguments of :func:`hqekv.patch_model` for this method; None for fp16 and quanto (unpatched)."""
        if self.kind in ("fp16", "quanto"):
            return None
        if self.kind in ("kivi", "rkivi"):
            rotation = "hadamard" if self.kind == "rkivi" else None
            return {"ratios": TierRatios(**{KIVI_BITS[int(self.bits)]: 1.0}), "protected_chunks": 0, "rotation": rotation}
        if self.kind == "evict":
            keep = min(1.0, (self.bits + METADATA_BITS) / 16)
            return {"ratios": TierRatios(fp16=keep, evict=1 - keep), "eviction": "key", "rotation": None}
        if self.kind == "auto":
            return {"bavg": self.bits, "ratios": "auto"}
        if self.kind == "heads":
            return {"bavg": self.bits, "ratios": "auto", "head_tiers": True}
        if self.kind == "shared":
            return {"bavg": self.bits, "ratios": "auto", "layer_bits": "shared"}
        if self.kind == "fallback":
            return {"bavg": self.bits, "ratios": uncalibrated_ratios(self.bits)}
        if self.kind == "random":
            return {"bavg": self.bits, "ratios": "calibrated", "importance": "random"}
        if self.kind == "calibrated":
            return {"bavg": self.bits, "ratios": "calibrated"}
        if self.kind == "paper":
            return {"bavg": self.bits, "rotation": None}
        if self.kind in ("rhqekv", "rpaper"):
            return {"bavg": self.bits, "rotation": "hadamard"}
        return {"bavg": self.bits}

    def new_cache(self, model):
        """An empty cache for one sample, or None when the (patched or plain) model makes its own."""
        if self.kind != "quanto":
            return None
        from transformers import QuantizedCache

        return QuantizedCache("quanto", model.config.get_text_config(), nbits=int(self.bits))

    @contextlib.contextmanager
    def applied(self, model, **settings):
        """Patch ``model`` for this method for the duration of the block (fp16, quanto: leave it as
        is); ``settings``: more :func:`hqekv.patch_model` arguments for a patched method."""
        from ..patching import patch_config, patch_model, unpatch_model

        if self.kind == "quanto":
            try:
                import optimum.quanto  # noqa: F401
            except ImportError as error:
                raise ImportError("the quanto:B method needs optimum-quanto: pip install optimum-quanto") from error
        kwargs = self.patch_kwargs()
        if self.kind in ONE_SET:
            from ..resolve import resolve_config

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                calibrated = resolve_config(model, self.bits, ratios="calibrated")
                kwargs = {**kwargs, "ratios": calibrated.ratios}  # one set, not per layer
        if kwargs is None:
            yield None
            return
        kwargs = {**kwargs, **settings}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the ratios' source is recorded instead
            patch_model(model, **kwargs)
        try:
            yield patch_config(model)
        finally:
            unpatch_model(model)


def parse_method(spec: str) -> Method:
    """``"fp16"``, ``"kivi:2"``, ``"evict:3.2"``, ``"hqekv:2.8"`` -> :class:`Method`."""
    match = re.fullmatch(r"([\w-]+)(?::([0-9.]+))?", spec.strip())
    if not match or match.group(1) not in KINDS:
        raise ValueError(
            f"unknown method {spec!r}; use fp16, kivi:B or rkivi:B (B in 1, 2, 4), evict:B, hqekv:B, rhqekv:B, "
            "calibrated:B, random:B, quanto:B (B in 2, 4), paper:B, rpaper:B, auto:B, shared:B, heads:B or fallback:B"
        )
    kind, bits = match.group(1), match.group(2)
    if kind == "fp16":
        if bits is not None:
            raise ValueError("fp16 takes no bit-width")
        return Method("fp16")
    if bits is None:
        raise ValueError(f"{kind} needs a bit-width, e.g. {kind}:2")
    value = check_bavg(float(bits))
    if kind == "quanto" and value not in QUANTO_BITS:
        raise ValueError(f"quanto quantizes to 2 or 4 bits, got {bits}")
    if kind in ("kivi", "rkivi") and value not in KIVI_BITS:
        raise ValueError(f"kivi stores every chunk at one tier: B must be 1, 2 or 4, got {bits}")
    if kind == "evict" and value + METADATA_BITS > 16:
        raise ValueError(f"evict:B keeps (B + {METADATA_BITS:g})/16 of the chunks: B must be at most {16 - METADATA_BITS:g}, got {bits}")
    return Method(kind, value)

"""Patch registry: ``config.model_type`` -> how to patch that architecture's attention.

Each family names its attention classes and how they project (q, k, v); the forward
around them is shared (:mod:`hqekv.patches.base`). Modeling modules are imported only
for the architecture being patched.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from .base import make_attention_forward, sliding_windows


@dataclass(frozen=True)
class ArchitecturePatch:
    """Attention classes of an architecture and the forward that replaces theirs."""

    attention_classes: tuple[type, ...]
    forward: Callable


@dataclass(frozen=True)
class _Family:
    module: str  # transformers.models.<module>.modeling_<module>
    attention: str  # attention class name in it
    projection: str  # hqekv.patches.<projection>: separate q/k/v, q/k norms, fused qkv


REGISTRY: dict[str, _Family] = {
    "llama": _Family("llama", "LlamaAttention", "llama"),
    "mistral": _Family("mistral", "MistralAttention", "llama"),
    "mixtral": _Family("mixtral", "MixtralAttention", "llama"),
    "qwen2": _Family("qwen2", "Qwen2Attention", "llama"),
    "qwen3": _Family("qwen3", "Qwen3Attention", "qk_norm"),
    "qwen3_moe": _Family("qwen3_moe", "Qwen3MoeAttention", "qk_norm"),
    "gemma3_text": _Family("gemma3", "Gemma3Attention", "qk_norm"),
    "phi3": _Family("phi3", "Phi3Attention", "phi3"),
}
SUPPORTED_MODEL_TYPES = tuple(REGISTRY)


def check_supported(text_config) -> None:
    """``ValueError`` for a model type or attention feature hqekv cannot run exactly."""
    model_type = text_config.model_type
    if model_type not in REGISTRY:
        raise ValueError(
            f"hqekv does not support model_type {model_type!r}; supported architectures: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(text_config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"{model_type}: attention logit soft-capping is not supported by hqekv's attention")
    if getattr(text_config, "use_bidirectional_attention", False):
        raise ValueError(f"{model_type}: bidirectional attention has no causal KV cache to compress")
    sliding_windows(text_config)  # raises for layer types other than full and sliding attention


def patch_for(text_config) -> ArchitecturePatch:
    """The patch for this text config's architecture, or a ``ValueError`` naming the supported ones."""
    check_supported(text_config)
    family = REGISTRY[text_config.model_type]
    modeling = importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")
    projection = importlib.import_module(f"{__name__}.{family.projection}")
    project = projection.projector(modeling.apply_rotary_pos_emb)
    return ArchitecturePatch((getattr(modeling, family.attention),), make_attention_forward(project, modeling.eager_attention_forward))

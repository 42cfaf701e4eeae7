"""Patch registry: ``config.model_type`` -> how to patch that architecture's attention.

Each family names its attention classes and how they project (q, k, v); the forward
around them is shared (:mod:`hqekv.patches.base`). Modeling modules are imported only
for the architecture being patched.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

from .base import PADDING_MASK, make_attention_forward, sliding_windows


@dataclass(frozen=True)
class _Family:
    module: str  # transformers.models.<module>.modeling_<module>
    attention: str  # attention class name in it
    projection: str  # hqekv.patches.<projection>: separate q/k/v, q/k norms, fused qkv


REGISTRY: dict[str, _Family] = {
    "llama": _Family("llama", "LlamaAttention", "llama"),
    "mistral": _Family("mistral", "MistralAttention", "llama"),
    "mixtral": _Family("mixtral", "MixtralAttention", "llama"),
    "ministral": _Family("ministral", "MinistralAttention", "llama"),
    "qwen2": _Family("qwen2", "Qwen2Attention", "llama"),
    "qwen2_moe": _Family("qwen2_moe", "Qwen2MoeAttention", "llama"),
    "granite": _Family("granite", "GraniteAttention", "llama"),
    "granitemoe": _Family("granitemoe", "GraniteMoeAttention", "llama"),
    "starcoder2": _Family("starcoder2", "Starcoder2Attention", "llama"),
    "helium": _Family("helium", "HeliumAttention", "llama"),
    "arcee": _Family("arcee", "ArceeAttention", "llama"),
    "seed_oss": _Family("seed_oss", "SeedOssAttention", "llama"),
    "ernie4_5": _Family("ernie4_5", "Ernie4_5Attention", "llama"),
    "glm": _Family("glm", "GlmAttention", "llama"),
    "smollm3": _Family("smollm3", "SmolLM3Attention", "llama"),
    "qwen3": _Family("qwen3", "Qwen3Attention", "qk_norm"),
    "qwen3_moe": _Family("qwen3_moe", "Qwen3MoeAttention", "qk_norm"),
    "gemma3_text": _Family("gemma3", "Gemma3Attention", "qk_norm"),
    "apertus": _Family("apertus", "ApertusAttention", "qk_norm"),
    "olmo2": _Family("olmo2", "Olmo2Attention", "full_qk_norm"),
    "olmo3": _Family("olmo3", "Olmo3Attention", "full_qk_norm"),
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


def attention_classes(text_config) -> tuple[type, ...]:
    """The attention module classes to patch for this text config (``ValueError`` if unsupported)."""
    check_supported(text_config)
    family = REGISTRY[text_config.model_type]
    return (getattr(_modeling(family), family.attention),)


def _modeling(family: _Family):
    return importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")


@functools.cache
def attention_forward(model_type: str) -> Callable:
    """The patched ``forward(module, hidden_states, ...)`` of a family's attention modules."""
    family = REGISTRY[model_type]
    modeling = _modeling(family)
    project = importlib.import_module(f"{__name__}.{family.projection}").projector(modeling.apply_rotary_pos_emb)
    return make_attention_forward(project, modeling.eager_attention_forward)


class PatchedAttention:
    """The ``forward`` set on one patched attention module.

    An object, not a closure, so that a patched model survives ``copy.deepcopy`` (the copy's
    modules run the copy's weights: ``module`` is copied with them) and pickles
    (``torch.save(model)``): it holds only the module and the family's name.
    """

    def __init__(self, module, model_type: str):
        self.module = module
        self.model_type = model_type
        self.forward = attention_forward(model_type)

    def __getstate__(self) -> dict:
        return {"module": self.module, "model_type": self.model_type}  # the forward is rebuilt by name

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["module"], state["model_type"])

    def __call__(self, *args, **kwargs):
        return self.forward(self.module, *args, **kwargs)

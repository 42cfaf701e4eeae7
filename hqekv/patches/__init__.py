"""Patch registry: ``config.model_type`` -> how to patch that architecture's attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ArchitecturePatch:
    """Attention classes of an architecture and the forward that replaces theirs."""

    attention_classes: tuple[type, ...]
    forward: Callable


def _llama() -> ArchitecturePatch:
    from . import llama

    return ArchitecturePatch(llama.ATTENTION_CLASSES, llama.forward)


REGISTRY: dict[str, Callable[[], ArchitecturePatch]] = {"llama": _llama}
SUPPORTED_MODEL_TYPES = tuple(REGISTRY)


def patch_for(model_type: str) -> ArchitecturePatch:
    """The patch for ``model_type``, or a ``ValueError`` naming the supported ones."""
    if model_type not in REGISTRY:
        raise ValueError(
            f"hqekv does not support model_type {model_type!r}; supported architectures: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return REGISTRY[model_type]()

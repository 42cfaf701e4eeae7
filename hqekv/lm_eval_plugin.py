"""lm-evaluation-harness model type ``hqekv``: a Hugging Face model patched by hqekv.

    python -m hqekv.lm_eval_plugin run --model hqekv \
        --model_args pretrained=meta-llama/Llama-3.1-8B-Instruct,bavg=3.2 --tasks ruler_niah_single_1
    accelerate launch -m hqekv.lm_eval_plugin run --model hqekv --model_args ...

``python -m hqekv.lm_eval_plugin`` is the ``lm_eval`` command with the ``hqekv`` model type
registered (lm-eval 0.4 discovers no third-party models by itself); in Python,
``import hqekv.lm_eval_plugin`` before ``lm_eval.simple_evaluate(model="hqekv", ...)``.
Install with ``pip install hqekv[eval]``.

Model arguments: everything ``hf`` takes (``pretrained``, ``gguf_file``, ``dtype``, ...)
plus ``bavg``, ``artifact`` and the cache settings of :func:`hqekv.patch_model`
(``chunk_size``, ``window``, ``rerank_interval``, ``protected_chunks``, ``eviction``,
``value_group``, ``fp_dtype``, ``rotation`` (``none`` for the paper's unrotated cache),
``importance``). The compressed cache changes what a model
generates after its prompt: generation tasks (LongBench, RULER, needle tests) measure it. A log-likelihood task scores
prompt and continuation in one forward, whose attention is exact, so it cannot tell the
methods apart.
"""

from __future__ import annotations

import dataclasses

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import hqekv
from hqekv.config import CACHE_SETTINGS, HqeKVConfig

PATCH_ARGS = ("bavg", "artifact", *CACHE_SETTINGS, "importance", "chunked_prefill")
"""The ``model_args`` that go to :func:`hqekv.patch_model`: every cache setting of HqeKVConfig."""
_INT_ARGS = tuple(f.name for f in dataclasses.fields(HqeKVConfig) if f.name in PATCH_ARGS and f.type in ("int", int))
_OPTIONAL_ARGS = tuple(f.name for f in dataclasses.fields(HqeKVConfig) if f.name in PATCH_ARGS and f.default is None)


def patch_arguments(kwargs: dict) -> dict:
    """Take the ``patch_model`` arguments out of lm-eval's ``model_args`` (strings on the command
    line): numbers converted, ``"none"`` for an optional setting (e.g. ``rotation``) meaning None."""
    patch = {k: kwargs.pop(k) for k in PATCH_ARGS if k in kwargs and kwargs[k] is not None}
    if "bavg" in patch:
        patch["bavg"] = float(patch["bavg"])
    for k in _INT_ARGS:
        if k in patch:
            patch[k] = int(patch[k])
    for k in _OPTIONAL_ARGS:
        if str(patch.get(k, "")).lower() == "none":
            patch[k] = None
    return patch


@register_model("hqekv")
class HqeKVLM(HFLM):
    """``HFLM`` whose model is patched with :func:`hqekv.patch_model` after loading."""

    def __init__(self, pretrained, **kwargs):
        patch = patch_arguments(kwargs)
        super().__init__(pretrained=pretrained, **kwargs)
        if hqekv.is_patched(self.model):
            hqekv.unpatch_model(self.model)  # a model object passed in twice: use these settings
        hqekv.patch_model(self.model, **patch)
        self.hqekv_config = hqekv.patch_config(self.model)


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()

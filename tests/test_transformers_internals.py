"""hqekv.transformers_internals: the one place hqekv leans on transformers internals. Each
internal it relies on is checked against the installed transformers, so that an upgrade
that moves one fails here, by name, rather than deep in a generate call."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import GenerationConfig, GenerationMixin

import hqekv
from hqekv import transformers_internals as internals

from .helpers import greedy, prompt, tiny_llama


def test_prepare_cache_for_generation_takes_the_cache_length_third():
    """``_PrepareCache`` reads ``max_cache_length`` as the third positional argument after
    ``generation_config`` and ``model_kwargs``, as ``generate`` passes it."""
    names = list(inspect.signature(GenerationMixin._prepare_cache_for_generation).parameters)
    assert names[:3] == ["self", "generation_config", "model_kwargs"]
    assert names[3:].index("max_cache_length") == 2


def test_generate_helpers_the_patch_replaces_exist():
    for name in ("_prepare_cache_for_generation", "prepare_inputs_for_generation", "_prefill",
                 "_valid_auto_compile_criteria", "generate"):  # fmt: skip
        assert callable(getattr(GenerationMixin, name, None)), name
    assert list(inspect.signature(GenerationMixin._valid_auto_compile_criteria).parameters)[1:] == [
        "model_kwargs", "generation_config"
    ]
    config = GenerationConfig()
    assert hasattr(config, "prefill_chunk_size") and hasattr(config, "disable_compile")
    source = inspect.getsource(GenerationMixin)
    assert 'getattr(self, "create_masks_for_generate"' in source  # the padding mask hook is looked up per model


def test_the_cache_argument_is_found_by_name():
    def new(input_ids=None, cache=None):
        return None

    def old(input_ids=None, past_key_values=None):
        return None

    assert internals.cache_argument(new) == "cache" and internals.cache_argument(old) == "past_key_values"
    assert internals.cache_argument(type(tiny_llama()).forward) in internals.CACHE_ARGUMENTS


def test_the_padding_mask_of_the_new_tokens():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert internals._input_valid(mask, 2).tolist() == [[True, True], [True, True]]
    assert internals._input_valid(mask, 4)[0].tolist() == [False, True, True, True]
    assert internals._input_valid(None, 3) is None
    with pytest.raises(NotImplementedError, match="2-D attention_mask"):
        internals._input_valid(mask[:, None], 2)
    with pytest.raises(ValueError, match="covers 4 tokens but the input has 5"):
        internals._input_valid(mask, 5)


def test_install_restores_what_it_replaced_when_it_fails():
    model = tiny_llama()
    before = dict(model.__dict__)
    record = internals.PatchRecord(hqekv.HqeKVConfig(ratios=hqekv.FP16_RATIOS, bavg=16.0))
    with pytest.raises(ValueError, match="found no attention modules"):
        internals.install(model, record, (torch.nn.Conv1d,), "llama")
    assert model.__dict__.keys() == before.keys() and record.saved == []


def test_generate_makes_a_static_cache_only_when_it_compiles():
    """The ``_valid_auto_compile_criteria`` that ``_PrepareCache`` asks decides: an eager
    generate keeps an exact cache, one with a compile config a static one."""
    from transformers import CompileConfig

    model = tiny_llama()
    hqekv.patch_model(model, ratios=hqekv.TierRatios(int4=0.5, int2=0.5))
    ids = prompt(40)
    out = greedy(model, ids, 3, return_dict_in_generate=True, disable_compile=True)
    assert not any(layer.capacity.keeps_addresses() for layer in hqekv.patching.output_cache(out).layers)
    config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told so
    torch._dynamo.reset()
    out = greedy(model, ids, 3, return_dict_in_generate=True, compile_config=config)
    assert all(layer.capacity.keeps_addresses() for layer in hqekv.patching.output_cache(out).layers)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3", "phi3", "mixtral", "mistral"])
def test_the_padding_mask_reaches_every_attention_layer_as_an_argument(family, monkeypatch):
    """The decoder's wrapper hands each attention layer the padding mask of the new tokens
    as an argument (through the decoder's keyword arguments), for prefill and decode, and
    leaves nothing on the cache for the attention to read back."""
    from hqekv.cache import HqeKVLayer, SlidingWindowLayer

    from .helpers import tiny_model

    model = hqekv.patch_model(tiny_model(family), ratios=hqekv.FP16_RATIOS)
    ids = prompt(40, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding of the second row
    seen = []
    for layer_class in (HqeKVLayer, SlidingWindowLayer):
        original = layer_class.attend

        def recording(self, query, key, value, scaling, new_valid=None, dense_attention=None, _original=original):
            seen.append(None if new_valid is None else new_valid.clone())
            return _original(self, query, key, value, scaling, new_valid, dense_attention)

        monkeypatch.setattr(layer_class, "attend", recording)
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
    layers = model.config.get_text_config().num_hidden_layers
    assert len(seen) == layers and all(torch.equal(v, mask.bool()) for v in seen)
    step = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    model(input_ids=ids[:, -1:], attention_mask=step, cache=cache, use_cache=True)
    assert len(seen) == 2 * layers and all(torch.equal(v, torch.ones(2, 1, dtype=torch.bool)) for v in seen[layers:])
    assert not hasattr(cache, "input_valid")

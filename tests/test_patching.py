"""The user surface: patch_model and unpatch_model, what they refuse, and a patched model through generate, pipelines, copies and pickles."""

import warnings

import pytest
import torch

import hqekv
from hqekv.patching import output_cache

from .helpers import MIXED, greedy, prompt, tiny_llama


def test_fp16_ratios_reproduce_unpatched_and_unpatch_is_exact(tiny):
    ids = prompt(150)
    ref = greedy(tiny, ids, 70)
    with torch.no_grad():
        logits_before = tiny(ids).logits
    hqekv.patch_model(tiny, ratios=hqekv.FP16_RATIOS, value_group=16, fp_dtype="model")
    assert torch.equal(greedy(tiny, ids, 70), ref)
    hqekv.unpatch_model(tiny)
    assert not hqekv.is_patched(tiny)
    with torch.no_grad():
        assert torch.equal(tiny(ids).logits, logits_before)
    assert "forward" not in tiny.model.__dict__ and "generate" not in tiny.__dict__


def test_requests_do_not_share_state(tiny):
    hqekv.patch_model(tiny, ratios=MIXED, value_group=16)
    ids = prompt(120, seed=5)
    first = greedy(tiny, ids, 40)
    greedy(tiny, prompt(300, seed=6), 40)
    assert torch.equal(greedy(tiny, ids, 40), first)


def test_pipeline_uses_the_hqekv_cache(tiny):
    from transformers import pipeline

    hqekv.patch_model(tiny, ratios=MIXED, value_group=16)

    seen = []
    original = hqekv.HqeKVLayer.attend

    def spy(self, *a, **k):
        seen.append(self)
        return original(self, *a, **k)

    hqekv.HqeKVLayer.attend = spy
    try:
        pipe = pipeline("text-generation", model=tiny, tokenizer=_char_tokenizer(), device="cpu")
        text = pipe("abcdefgh" * 20, max_new_tokens=5, do_sample=False)[0]["generated_text"]
    finally:
        hqekv.HqeKVLayer.attend = original
    assert len(text) > 0 and len(seen) > 0


def _char_tokenizer():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(ord("a") + i): i + 3 for i in range(26)}
    vocab.update({"<pad>": 0, "<s>": 1, "</s>": 2})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>")


def test_bad_inputs(tiny):
    with pytest.raises(ValueError, match="bavg"):
        hqekv.patch_model(tiny, bavg=0)
    with pytest.raises(ValueError, match="bavg"):
        hqekv.patch_model(tiny, bavg=17)
    with pytest.raises(ValueError, match="bavg"):
        hqekv.patch_model(tiny, bavg=float("nan"))
    with pytest.raises(ValueError, match="sum to 1"):
        hqekv.patch_model(tiny, ratios=(0.5, 0.2, 0.2, 0.2))
    with pytest.raises(ValueError, match="eq. 6"):
        hqekv.patch_model(tiny, bavg=3.2, ratios=(0.5, 0.5, 0.0, 0.0))
    with pytest.raises(TypeError, match="causal language model"):
        hqekv.patch_model(torch.nn.Linear(2, 2))
    from transformers import BertConfig, BertModel

    with pytest.raises(TypeError, match="causal language model"):
        hqekv.patch_model(BertModel(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=32)))
    assert not hqekv.is_patched(tiny)  # failed patches leave nothing behind


def test_unsupported_architecture_names_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="supported architectures: llama"):
        hqekv.patch_model(model, ratios=MIXED)


def test_runtime_errors(tiny):
    hqekv.patch_model(tiny, ratios=MIXED, value_group=16)
    with pytest.raises(ValueError, match="already patched"):
        hqekv.patch_model(tiny, ratios=MIXED)
    with pytest.raises(ValueError, match="empty"):
        with torch.no_grad():
            tiny(torch.zeros(1, 0, dtype=torch.long))
    ids = prompt(40, batch=2)
    from transformers import DynamicCache

    with pytest.raises(TypeError, match="DynamicCache"):
        with torch.no_grad():
            tiny(ids, cache=DynamicCache())
    # NaN activations: a clear error, not NaN codes
    tiny.model.layers[0].self_attn.k_proj.weight.data[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        with torch.no_grad():
            tiny(prompt(64))


def test_without_calibrated_ratios_the_allocator_runs_and_warns(tiny):
    with pytest.warns(hqekv.UncalibratedRatiosWarning, match="rate-distortion allocator"):
        hqekv.patch_model(tiny, bavg=2.0, value_group=16)
    config = hqekv.patch_config(tiny)
    assert config.allocation == "rate-distortion" and config.bavg == 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hqekv.unpatch_model(tiny)
        hqekv.patch_model(tiny, ratios=MIXED, value_group=16)  # explicit ratios: silent


def test_use_cache_false_is_plain_attention(tiny):
    ids = prompt(70)
    with torch.no_grad():
        ref = tiny(ids, use_cache=False).logits
    hqekv.patch_model(tiny, ratios=MIXED, value_group=16)
    with torch.no_grad():
        assert torch.equal(tiny(ids, use_cache=False).logits, ref)


def test_explicit_key_ratios_and_their_errors(tiny):
    keys = hqekv.TierRatios(int4=0.8, evict=0.2)
    values = hqekv.TierRatios(int2=0.8, evict=0.2)
    hqekv.patch_model(tiny, ratios=values, key_ratios=keys, value_group=16)
    config = hqekv.patch_config(tiny)
    assert config.key_ratios == keys and config.bavg == pytest.approx((3.2 + 1.6) / 2)
    greedy(tiny, prompt(300), 40)
    hqekv.unpatch_model(tiny)
    with pytest.raises(ValueError, match="key_ratios= needs ratios="):
        hqekv.patch_model(tiny, bavg=2.0, key_ratios=keys)
    assert not hqekv.is_patched(tiny)


def test_deepcopy_of_a_patched_model_runs_the_copy():
    import copy

    model = tiny_llama(seed=3)
    hqekv.patch_model(model, ratios=hqekv.FP16_RATIOS, value_group=16, fp_dtype="model")
    ids = prompt(100)
    original = greedy(model, ids, 20)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
    attention = clone.model.layers[0].self_attn
    assert attention.forward.module is attention  # the copy's modules run the copy's weights
    patched = greedy(clone, ids, 20)
    assert not torch.equal(patched, original)
    assert torch.equal(greedy(model, ids, 20), original)  # the original is untouched
    hqekv.unpatch_model(clone)
    assert torch.equal(greedy(clone, ids, 20), patched)  # FP16 ratios: patched copy = unpatched copy
    assert hqekv.is_patched(model)


def test_a_patched_model_pickles_and_loads_patched(tmp_path):
    model = tiny_llama(seed=4)
    hqekv.patch_model(model, ratios=MIXED, value_group=16)
    ids = prompt(120)
    expected = greedy(model, ids, 40)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert hqekv.is_patched(loaded) and hqekv.patch_config(loaded) == hqekv.patch_config(model)
    assert torch.equal(greedy(loaded, ids, 40), expected)
    hqekv.unpatch_model(loaded)
    assert "forward" not in loaded.model.__dict__ and "generate" not in loaded.__dict__


def test_output_attentions_is_refused_not_silently_empty():
    model = tiny_llama(seed=5)
    model.set_attn_implementation("eager")
    hqekv.patch_model(model, ratios=MIXED, value_group=16)
    ids = prompt(40)
    with pytest.raises(ValueError, match="returns no attention weights"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="returns no attention weights"):
        model.generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)
    with torch.no_grad():  # without a cache the attention is exact and its weights come back
        assert len(model(ids, output_attentions=True, use_cache=False).attentions) == 2


@pytest.mark.parametrize("implementation", ["static", "quantized"])
def test_a_cache_implementation_asked_of_a_patched_model_is_an_error(tiny, implementation):
    from transformers import GenerationConfig

    hqekv.patch_model(tiny, ratios=MIXED, value_group=16)
    with pytest.raises(ValueError, match=f"cache_implementation='{implementation}'"):
        tiny.generate(prompt(40), max_new_tokens=2, cache_implementation=implementation)
    with pytest.raises(ValueError, match="patched by hqekv"):
        tiny.generate(prompt(40), generation_config=GenerationConfig(max_new_tokens=2, cache_implementation=implementation))


def test_the_models_own_cache_implementation_is_replaced_with_a_warning(tiny):
    tiny.generation_config.cache_implementation = "hybrid"
    hqekv.patch_model(tiny, ratios=MIXED, value_group=16)
    with pytest.warns(UserWarning, match="uses an HqeKVCache instead"):
        out = tiny.generate(prompt(40), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert isinstance(output_cache(out), hqekv.HqeKVCache)


def test_a_reused_cache_given_a_prompt_no_longer_than_it_says_so():
    """``generate`` feeds a passed cache only what follows the tokens it holds; an unrelated
    shorter prompt leaves nothing, which used to read "the prompt has no tokens"."""
    model = tiny_llama()
    hqekv.patch_model(model, ratios=hqekv.TierRatios(int4=1.0))
    gen = torch.Generator().manual_seed(0)
    cache = hqekv.new_cache(model)
    with torch.no_grad():
        model(torch.randint(1, 128, (1, 100), generator=gen), cache=cache)
        with pytest.raises(ValueError, match="for a cache that holds 100.*pass a new cache"):
            model.generate(torch.randint(1, 128, (1, 50), generator=gen), past_key_values=cache, max_new_tokens=3)


def test_a_wrong_number_of_layer_ratios_is_named_as_such():
    model = tiny_llama(layers=2)
    r = hqekv.TierRatios(int4=0.5, int2=0.5)
    with pytest.raises(ValueError, match="3 layer_ratios for a llama model with 2 global attention layers"):
        hqekv.patch_model(model, ratios=r, layer_ratios=[r, r, hqekv.TierRatios(int4=1.0)])

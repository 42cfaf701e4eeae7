"""Every supported family, on tiny random models built from its transformers config class
(tests/helpers.py): exact FP16 identity, re-ranking at real budgets, byte accounting,
padding, unpatching, sliding-window layers and compiled decode."""

from __future__ import annotations

import warnings

import pytest
import torch

import hqekv
from hqekv.cache import HqeKVLayer
from hqekv.patching import output_cache
from hqekv.cache.sliding import SlidingWindowLayer, sliding_attention
from .. import helpers
from ..helpers import FAMILIES, MIXED, SLIDING_WINDOW, compiled_generate, greedy, sharpen_attention, stored_bytes
from ..helpers import tiny_model
from ..helpers import assert_left_padding_matches_single_rows

BUDGETS = (2.0, 3.2)


def prompt(n, seed=0, batch=1):
    return helpers.prompt(n, seed, batch, low=3)  # above the families' special tokens


def patch(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the uncalibrated-ratios and all-sliding warnings
        return hqekv.patch_model(model, value_group=16, **kw)


def test_every_family_is_registered():
    assert set(FAMILIES) == set(hqekv.SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp16_ratios_reproduce_unpatched_and_unpatch_is_exact(family):
    model = tiny_model(family)
    ids = prompt(150)  # longer than the sliding window
    with torch.no_grad():
        logits = model(ids).logits
    ref = greedy(model, ids, 40)
    patch(model, ratios=hqekv.FP16_RATIOS, fp_dtype="model")
    assert torch.equal(greedy(model, ids, 40), ref)
    hqekv.unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert "generate" not in model.__dict__


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_in_two_pieces_gives_the_unpatched_logits(family):
    """The second piece attends through hqekv's own attention over the cached keys, which
    must carry the model's positional encoding (RoPE, partial RoPE, none on NoPE layers),
    norms and scaling: with attention sharp enough for each of them to change the logits."""
    model = tiny_model(family)
    sharpen_attention(model)
    ids = prompt(150)  # longer than the sliding window
    with torch.no_grad():
        full = model(ids).logits[:, 100:]
    patch(model, ratios=hqekv.FP16_RATIOS, fp_dtype="model")
    with torch.no_grad():
        first = model(ids[:, :100], use_cache=True)
        second = model(ids[:, 100:], cache=output_cache(first), use_cache=True).logits
    torch.testing.assert_close(second, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "family, bavg",
    [(family, BUDGETS[0]) for family in FAMILIES] + [(family, BUDGETS[1]) for family in ("llama", "gemma3_text", "phi3")],
)  # every family at one budget; a second budget where the attention differs most
def test_budgets_rerank_and_every_byte_is_reported(family, bavg):
    model = tiny_model(family)
    patch(model, bavg=bavg)
    layers = []

    original = HqeKVLayer.rerank

    def counting(self, rows, **kwargs):
        layers.append(self.layer_idx)
        original(self, rows, **kwargs)

    HqeKVLayer.rerank = counting
    try:
        with torch.no_grad():
            out = model.generate(prompt(200), max_new_tokens=100, min_new_tokens=100, do_sample=False,
                                 return_dict_in_generate=True)  # fmt: skip
    finally:
        HqeKVLayer.rerank = original
    cache = output_cache(out)
    global_layers = [i for i, layer in enumerate(cache.layers) if isinstance(layer, HqeKVLayer)]
    if global_layers:
        for i in global_layers:  # the prefill's re-rank and at least two during decode
            assert layers.count(i) >= 3
    report = hqekv.memory_report(cache)
    assert report.total_bytes == stored_bytes(cache)
    if global_layers:
        assert report.ratio_to_dense < 1
    windows = [layer for layer in cache.layers if isinstance(layer, SlidingWindowLayer)]
    assert report.bytes_by_part.get("sliding", 0) == sum(layer.storage()["sliding"] for layer in windows)


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_with_left_padding_equals_each_row_alone(family):
    model = tiny_model(family, seed=1)
    patch(model, ratios=MIXED)
    assert_left_padding_matches_single_rows(model, 40, low=3)  # above the families' special tokens


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_sliding_layers_hold_exactly_the_window(family):
    model = tiny_model(family)
    patch(model, bavg=2.0)
    with torch.no_grad():
        out = model(prompt(130), use_cache=True)
    cache = output_cache(out)
    kinds = [type(layer) for layer in cache.layers]
    expected = hqekv.patches.sliding_windows(model.config)
    assert kinds == [HqeKVLayer if w is None else SlidingWindowLayer for w in expected]
    layer = next(layer for layer in cache.layers if isinstance(layer, SlidingWindowLayer))
    assert layer.buffer.keys.shape[2] == SLIDING_WINDOW - 1 and bool(layer.buffer.valid.all())
    # the report's dense baseline is the unpatched model's window, not the whole prompt
    report = hqekv.memory_report(cache)
    n_sliding = kinds.count(SlidingWindowLayer)
    assert report.bytes_by_part["sliding"] == n_sliding * (2 * layer.buffer.keys.nbytes + layer.buffer.valid.nbytes)


def test_a_config_that_turns_sliding_off_slides_nowhere():
    """SmolLM3 slides a layer only when ``use_sliding_window`` is set, whatever ``layer_types`` says."""
    import transformers as T

    config = T.SmolLM3Config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                             sliding_window=SLIDING_WINDOW, use_sliding_window=False)  # fmt: skip
    assert hqekv.patches.sliding_windows(config) == [None, None]
    config.use_sliding_window = True
    assert hqekv.patches.sliding_windows(config) == [SLIDING_WINDOW, None]


def test_multi_token_input_on_a_filled_window_equals_the_unpatched_model():
    """A second chunk of prompt, longer than the window, attends within the window only."""
    model = tiny_model("mistral")
    ids = prompt(160)
    with torch.no_grad():
        full = model(ids).logits[:, -40:]
    patch(model, ratios=hqekv.FP16_RATIOS, fp_dtype="model")
    with torch.no_grad():
        first = model(ids[:, :120], use_cache=True)
        second = model(ids[:, 120:], cache=output_cache(first), use_cache=True).logits
    torch.testing.assert_close(second, full, atol=1e-5, rtol=1e-5)


def test_sliding_attention_masks_by_distance_and_validity():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen) for n in (3, 7, 7))
    index = torch.arange(-4, 3)  # 4 cached slots, then the 3 new tokens
    valid = torch.tensor([[False, True, True, True, True, True, True]])
    out = sliding_attention(q, k, v, index, valid, index[4:], 3, 0.5)
    for s in range(3):
        keep = (index <= s) & (index > s - 3) & valid[0]
        w = torch.softmax(torch.einsum("hd,hnd->hn", q[0, :, s], k[0][:, keep]) * 0.5, -1)
        torch.testing.assert_close(out[0, s], torch.einsum("hn,hnd->hd", w, v[0][:, keep]), atol=1e-6, rtol=1e-6)
    nothing = sliding_attention(q, k, v, index, torch.zeros_like(valid), index[4:], 3, 0.5)
    assert torch.equal(nothing, torch.zeros_like(nothing))  # a query that sees no key


def test_all_sliding_model_warns_that_nothing_is_compressed():
    with pytest.warns(UserWarning, match="compresses nothing"):
        hqekv.patch_model(tiny_model("mistral"), ratios=hqekv.FP16_RATIOS, value_group=16)


def test_unsupported_features_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="supported architectures: llama, mistral"):
        hqekv.patch_model(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))
    model = tiny_model("gemma3_text")
    model.config.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="soft-capping"):
        hqekv.patch_model(model, ratios=hqekv.FP16_RATIOS, value_group=16)
    assert not hqekv.is_patched(model)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_compiled_decode_equals_eager(family):
    model = tiny_model(family)
    patch(model, ratios=hqekv.TierRatios(int4=0.3, int2=0.4, int1=0.2, evict=0.1))
    ids = prompt(70, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    inputs = {"input_ids": ids, "attention_mask": mask, "pad_token_id": 0}
    eager = greedy(model, ids, 70, attention_mask=mask, pad_token_id=0)
    compiled, per_step = compiled_generate(model, inputs, 70, "inductor")
    assert torch.equal(compiled, eager)
    assert per_step[-1] == per_step[1], per_step  # flushes and re-ranks compile nothing new


def test_calibrating_a_model_with_no_global_layer_is_refused():
    from hqekv.calibration import CompressionObjective

    ids = prompt(100)
    with pytest.raises(ValueError, match="no ratios to calibrate"):
        CompressionObjective(tiny_model("mistral"), ids, ids[:, :20], value_group=16)


@pytest.mark.parametrize("head_dim, group", [(96, 32), (80, 16)])
def test_head_dims_that_64_does_not_divide_work_with_default_settings(head_dim, group):
    """Phi-3's head dim 96, and 80, used to fail with the default value group of 64, and the
    error's hint (value_group=32) did not work for 80."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=2 * head_dim, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=head_dim, max_position_embeddings=1024)).eval()  # fmt: skip
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(1))
    hqekv.patch_model(model, ratios=hqekv.TierRatios(int4=0.3, int2=0.2, int1=0.2, evict=0.3))
    assert hqekv.patch_config(model).value_group == group
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    chunks = out.cache.memory_report().chunks
    assert chunks["evicted"] > 0 and chunks["v.int2"] > 0 and chunks["v.int1"] > 0
    hqekv.unpatch_model(model)
    with pytest.raises(ValueError, match=f"value_group={group}, or leave it out"):
        hqekv.patch_model(model, ratios=hqekv.TierRatios(int4=1.0), value_group=64)

"""Qwen2.5-Coder-0.5B-Instruct (qwen2, GQA 7:1, QKV bias) and Gemma-3-270M (gemma3, sliding
layers, one KV head, head dim 256) on their real weights, kept short: one pass-key prompt per
model (1K tokens for Qwen2.5, 2K for Gemma3, which misses the pass key at 1K uncompressed),
each model loaded once per test run."""

import pytest
import torch

import hqekv
from hqekv.texts import passkey_prompt
from hqekv.cache import SlidingWindowLayer
from tests.helpers import stored_bytes

pytestmark = pytest.mark.slow

# fixture: (seed, depth, prompt tokens) where the uncompressed model finds the pass key
CASES = {"qwen25": (2, 0.75, 1000), "gemma3": (2, 0.75, 2000)}


def _generate(model, inputs, n, **kw):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


@pytest.mark.parametrize("name", CASES)
def test_fp16_ratios_reproduce_and_a_pass_key_survives_bavg_3_2(name, request):
    model, tok = request.getfixturevalue(name)
    seed, depth, n_tokens = CASES[name]
    text, passkey = passkey_prompt(tok, n_tokens, depth=depth, seed=seed)
    inputs = tok(text, return_tensors="pt", add_special_tokens=False)
    n_prompt = inputs.input_ids.shape[1]
    assert n_tokens <= n_prompt <= n_tokens + 200
    reference = _generate(model, inputs, 12)
    assert passkey in tok.decode(reference[0, n_prompt:]), "the uncompressed model misses the pass key"

    hqekv.patch_model(model, ratios=hqekv.FP16_RATIOS, fp_dtype="model")
    try:
        assert torch.equal(_generate(model, inputs, 12), reference)
    finally:
        hqekv.unpatch_model(model)

    hqekv.patch_model(model, bavg=3.2)  # the ratios shipped for this model; Gemma3: the allocator at their bytes
    try:
        config = hqekv.patch_config(model)
        superseded = name == "gemma3"
        assert config.ratios_source.startswith("rate-distortion at the bytes of shipped:" if superseded else "shipped:")
        assert (config.allocation == "rate-distortion") == superseded
        if superseded:  # no layer_sensitivity in the artifact: its shipped layer profile splits the budget
            assert "layer profile" in config.ratios_source and len(config.layer_bits) == 3
        cache = hqekv.new_cache(model)
        out = _generate(model, inputs, 12, cache=cache)
    finally:
        hqekv.unpatch_model(model)
    assert passkey in tok.decode(out[0, n_prompt:])
    report = hqekv.memory_report(cache)
    assert report.total_bytes == stored_bytes(cache)
    assert report.total_bytes < 0.5 * report.dense_bytes
    sliding = [layer for layer in cache.layers if isinstance(layer, SlidingWindowLayer)]
    assert bool(sliding) == (name == "gemma3")
    if sliding:  # Gemma3: 15 sliding layers of 512 − 1 tokens, 3 global layers compressed
        assert len(sliding) == 15 and all(layer.buffer.keys.shape[2] == 511 for layer in sliding)


def test_qwen25_at_bavg_2_runs_the_allocator_split_by_its_artifact_s_layer_sensitivity(qwen25):
    """bavg 2: the shipped artifact is superseded by the allocator at its bytes, each layer at
    its own budget split by the sensitivity the artifact measured (docs/results.md, "Layers
    at budgets split by their measured sensitivity"); ``ratios="calibrated"`` is the artifact."""
    import warnings

    from hqekv.artifacts import SHIPPED_DIR, load_artifact
    from hqekv.calibration import split_budget

    model, _ = qwen25
    name = "qwen2.5-coder-0.5b-instruct-bavg2.safetensors"
    sensitivity = load_artifact(SHIPPED_DIR / name).metadata["layer_sensitivity"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hqekv.patch_model(model, bavg=2.0)
    try:
        config = hqekv.patch_config(model)
    finally:
        hqekv.unpatch_model(model)
    assert config.allocation == "rate-distortion"
    assert config.ratios_source.startswith(f"rate-distortion at the bytes of shipped:{name}, split")
    assert config.layer_bits == pytest.approx(split_budget(config.bavg, sensitivity, hqekv.allocation.LAYER_STRENGTH))
    assert len(config.layer_bits) == model.config.num_hidden_layers
    assert max(range(len(sensitivity)), key=lambda i: config.layer_bits[i]) == max(range(len(sensitivity)), key=sensitivity.__getitem__)
    hqekv.patch_model(model, bavg=2.0, ratios="calibrated")
    try:
        assert hqekv.patch_config(model).ratios_source == f"shipped:{name}"
    finally:
        hqekv.unpatch_model(model)


def test_qwen25_finds_its_shipped_artifacts_at_the_extreme_budgets(qwen25):
    """bavg 1 and 0.5 resolve to Qwen2.5-Coder's calibrated artifacts, not the allocator: on
    held-out multi-value needles they keep every value the allocator drops some of
    (docs/results.md, extreme budgets); no UncalibratedRatiosWarning."""
    import warnings

    model, _ = qwen25
    for bavg in (1.0, 0.5):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            hqekv.patch_model(model, bavg=bavg)
        try:
            config = hqekv.patch_config(model)
        finally:
            hqekv.unpatch_model(model)
        name = f"qwen2.5-coder-0.5b-instruct-bavg{bavg:g}.safetensors"
        assert config.allocation == "ratios" and config.ratios_source == f"shipped:{name}"
        assert config.layer_ratios is not None and len(config.layer_ratios) == model.config.num_hidden_layers

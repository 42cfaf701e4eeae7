"""End to end on SmolLM2-135M-Instruct (real weights, CPU reference path)."""

import warnings

import pytest
import torch

import hqekv
from hqekv.texts import passkey_prompt
from tests.helpers import stored_bytes

pytestmark = pytest.mark.slow


def _generate(model, inputs, n):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)


def test_all_fp16_ratios_generate_the_unpatched_tokens_on_2k_prompt(smollm2):
    model, tok = smollm2
    text, _ = passkey_prompt(tok, 2000, depth=0.5, seed=11)
    inputs = tok(text, return_tensors="pt")
    assert inputs.input_ids.shape[1] >= 2000
    with torch.no_grad():
        logits_before = model(inputs.input_ids[:, :300]).logits
    reference = _generate(model, inputs, 40)
    hqekv.patch_model(model, ratios=hqekv.FP16_RATIOS, fp_dtype="model")
    try:
        assert torch.equal(_generate(model, inputs, 40), reference)
    finally:
        hqekv.unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(model(inputs.input_ids[:, :300]).logits, logits_before)


# Depths where the uncompressed 135M model itself finds the pass key (it misses most
# needles in the first half of a 2K haystack); the test is that compression keeps it.
PASSKEY_CASES = [(2, 0.75), (4, 0.9)]


@pytest.mark.parametrize("bavg", [3.2, 2.0])
@pytest.mark.parametrize("seed,depth", PASSKEY_CASES)
def test_passkey_survives_compression(smollm2, bavg, seed, depth):
    model, tok = smollm2
    text, passkey = passkey_prompt(tok, 2000, depth=depth, seed=seed)
    inputs = tok(text, return_tensors="pt")
    n_prompt = inputs.input_ids.shape[1]
    baseline = tok.decode(_generate(model, inputs, 12)[0, n_prompt:])
    assert passkey in baseline, f"uncompressed model misses the pass key: {baseline!r}"

    hqekv.patch_model(model, bavg=bavg)  # the calibrated ratios shipped for SmolLM2
    assert hqekv.patch_config(model).ratios_source.startswith("shipped:")
    try:
        cache = hqekv.new_cache(model)
        with torch.no_grad():
            out = model.generate(**inputs, cache=cache, max_new_tokens=12, do_sample=False)
        answer = tok.decode(out[0, n_prompt:])
        report = hqekv.memory_report(cache)
    finally:
        hqekv.unpatch_model(model)
    assert passkey in answer, f"bavg={bavg}: {answer!r}"
    assert report.total_bytes == stored_bytes(cache)
    # compression really happened, at about the bits asked for (plus top-2 FP16 chunks and tail)
    assert bavg <= report.bavg <= bavg + 0.6
    assert report.total_bytes < 0.45 * report.fp16_bytes


def test_shipped_artifacts_cover_smollm2_at_every_advertised_bavg(smollm2):
    import warnings

    from hqekv.artifacts import find_shipped, model_fingerprint

    model, _ = smollm2
    settings = {"chunk_size": 32, "window": 20, "rerank_interval": 32, "protected_chunks": 2,
                "eviction": "joint", "value_group": 64}
    for bavg in (2.0, 2.8, 3.2, 3.25):
        artifact = find_shipped(model_fingerprint(model), bavg, settings)
        assert artifact is not None, f"no shipped artifact for SmolLM2 at bavg={bavg}"
        assert artifact.metadata["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        meta = artifact.metadata
        assert meta["trials"] >= 40 and meta["kl_scale"] == "log"
        assert meta["segments"] * (meta["context_tokens"] + meta["continuation_tokens"]) == 16384
        assert meta["context_tokens"] + meta["continuation_tokens"] <= model.config.max_position_embeddings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no UncalibratedRatiosWarning
        hqekv.patch_model(model)
    try:
        config = hqekv.patch_config(model)
        assert config.bavg == hqekv.DEFAULT_BAVG and config.ratios_source.startswith("shipped:")
    finally:
        hqekv.unpatch_model(model)


def test_cli_info_on_the_model_lists_its_shipped_artifacts(capsys):
    import json

    from hqekv.cli import main

    assert main(["info", "--model", "smollm2", "--json"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["supported"] and record["num_key_value_heads"] == 3 and record["head_dim"] == 64
    assert sorted(record["shipped_artifacts"]) == sorted(
        f"smollm2-135m-instruct-bavg{b}.safetensors" for b in ("2", "2.8", "3.2", "3.25")
    )
    assert record["superseded_artifacts"] == []  # SmolLM2's artifacts stay its default


def test_cli_profile_writes_what_patch_model_splits_the_allocator_by(smollm2, own_artifacts, monkeypatch):
    """`hqekv calibrate --profile` on the real model: a profile per layer, found by patch_model."""
    from hqekv import cli, packaged_models, profiles

    model, tok = smollm2
    monkeypatch.setattr(packaged_models, "load_model", lambda *a, **k: (model, tok, "HuggingFaceTB/SmolLM2-135M-Instruct"))
    argv = ["calibrate", "--model", "smollm2", "--profile", "--context-tokens", "448", "--continuation-tokens", "64",
            "--segments", "1", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    profile = profiles.load_profile(own_artifacts / "smollm2-135m-instruct-layers.safetensors")
    assert len(profile.sensitivity) == 30 and min(profile.sensitivity) > 0
    assert max(profile.sensitivity) > 10 * min(profile.sensitivity)  # the layers differ by orders of magnitude
    hqekv.patch_model(model, 1.5)  # no artifact at 1.5: the allocator, split by the profile
    try:
        config = hqekv.patch_config(model)
        assert config.layer_bits == pytest.approx(profile.layer_bits(1.5)) and "layer profile" in config.ratios_source
        text, passkey = passkey_prompt(tok, 1000, depth=0.75, seed=2)
        inputs = tok(text, return_tensors="pt")
        assert _generate(model, inputs, 3).shape[1] == inputs.input_ids.shape[1] + 3
    finally:
        hqekv.unpatch_model(model)


def test_the_shipped_profile_splits_the_allocator_where_no_artifact_is(smollm2):
    from hqekv import profiles

    model, _ = smollm2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # measured for this model: no UncalibratedRatiosWarning
        hqekv.patch_model(model, 1.0)
    config = hqekv.patch_config(model)
    hqekv.unpatch_model(model)
    (profile,) = [p for p in profiles.shipped_profiles() if "smollm2" in p.path.name]
    assert config.allocation == "rate-distortion" and config.layer_bits == pytest.approx(profile.layer_bits(1.0))
    assert config.ratios_source.endswith(f"layer profile {profile.path}")
    hqekv.patch_model(model, 2.0)  # where an artifact ships, it stays the default
    assert hqekv.patch_config(model).ratios_source.startswith("shipped:")
    hqekv.unpatch_model(model)

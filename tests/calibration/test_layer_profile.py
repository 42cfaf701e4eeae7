"""Layer profiles: measured per model, stored, found by patch_model, and used to split the
allocator's budget over the layers."""

import json
import math
import warnings

import pytest
import torch

import hqekv
from hqekv import allocation, artifacts, profiles
from hqekv.artifacts import ArtifactError, save_artifact
from hqekv.calibration import PROFILE_BITS, allocator_sensitivity, mean_kl, measure_profile
from hqekv.resolve import UncalibratedRatiosWarning

from ..helpers import CharTokenizer, metadata, tiny_llama, tiny_objective


@pytest.fixture(scope="module")
def objective():
    return tiny_objective(layers=3)


def test_allocator_sensitivity_is_each_layer_alone_under_the_allocator(objective):
    """One compressed prefill and a forward per layer give what a patched model gives with
    that layer alone at the budget and every other at 16 bits, one prefill per layer."""
    model, context, continuation, obj = objective
    fast = allocator_sensitivity(obj, 1.0)
    slow = []
    for j in range(3):
        layer_bits = [16.0] * 3
        layer_bits[j] = 1.0
        hqekv.patch_model(model, ratios="auto", layer_bits=layer_bits)
        try:
            with torch.no_grad():
                cache = hqekv.patching.output_cache(model(context, use_cache=True, logits_to_keep=1))
                logits = model(continuation, cache=cache, use_cache=True).logits[0].float()
        finally:
            hqekv.unpatch_model(model)
        slow.append(mean_kl(obj.reference, logits.log_softmax(-1)))
    assert min(slow) > 1e-6 and max(slow) > 1.5 * min(slow)  # the layers differ: a real signal
    assert fast == pytest.approx(slow, rel=1e-4)
    assert allocator_sensitivity(obj, 3.0) != pytest.approx(fast, rel=0.05)  # the budget matters


def profile_metadata(model, **overrides):
    meta = {k: v for k, v in metadata(model).items() if k not in ("bavg", "alpha", "beta", "trials", "best_loss")}
    return {**meta, "bits": 1.0, "rotation": None, **overrides}


def test_profile_round_trips_and_rejects_defects(tmp_path, tiny):
    path = profiles.save_profile(tmp_path, [0.01, 0.002], profile_metadata(tiny))
    assert path.name == "llama-layers.safetensors"
    profile = profiles.load_profile(path)
    assert profile.sensitivity == (0.01, 0.002) and profile.metadata["bits"] == 1.0
    assert profile.layer_bits(2.0) == pytest.approx(allocation.split_budget(2.0, [0.01, 0.002], allocation.LAYER_STRENGTH))
    assert "per-layer budgets at bavg 2" in profile.describe()
    with pytest.raises(ArtifactError, match="lacks"):
        profiles.save_profile(tmp_path, [0.01], {"model_id": "x"})
    with pytest.raises(ArtifactError, match="finite sensitivity"):
        profiles.save_profile(tmp_path, [0.01, float("nan")], profile_metadata(tiny))
    with pytest.raises(ArtifactError, match="not an hqekv layer profile"):
        profiles.load_profile(save_artifact(tmp_path, hqekv.TierRatios(int4=0.5, int2=0.5), metadata(tiny, bavg=3.0)))
    with pytest.raises(ArtifactError, match="not an hqekv ratios artifact"):
        artifacts.load_artifact(path)
    from safetensors.torch import save

    meta = {k: json.dumps(v) for k, v in {**profile.metadata, "layer_sensitivity": [0.5, 0.002]}.items()}
    tampered = tmp_path / "tampered-layers.safetensors"
    tampered.write_bytes(save({"layer_sensitivity": torch.tensor([0.01, 0.002], dtype=torch.float64)}, metadata=meta))
    with pytest.raises(ArtifactError, match="disagrees"):
        profiles.load_profile(tampered)
    for field, value in (("bits", 16.0), ("chunk_size", 0)):
        bad = profiles.save_profile(tmp_path / f"{field}-layers.safetensors", [0.01, 0.002],
                                    profile_metadata(tiny, **{field: value}))  # fmt: skip
        with pytest.raises(ArtifactError, match=f"invalid metadata: {field}="):
            profiles.load_profile(bad)
    truncated = tmp_path / "cut-layers.safetensors"
    truncated.write_bytes(path.read_bytes()[:50])
    with pytest.raises(ArtifactError, match="corrupt or truncated"):
        profiles.load_profile(truncated)


def test_artifact_searches_skip_profiles_beside_artifacts(tmp_path, tiny):
    profiles.save_profile(tmp_path, [0.01, 0.002], profile_metadata(tiny))
    ratios = save_artifact(tmp_path, hqekv.TierRatios(int4=0.5, int2=0.5), metadata(tiny, bavg=3.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a profile is not an unreadable artifact
        found = artifacts.find_artifact(tmp_path, artifacts.model_fingerprint(tiny), None, {})
    assert found.path == ratios
    assert all(not p.name.endswith(artifacts.PROFILE_SUFFIX) for p in artifacts.shipped_artifacts())


def test_patch_model_splits_the_allocators_budget_by_the_models_profile(own_artifacts, tiny):
    profiles.save_profile(own_artifacts, [0.02, 0.001], profile_metadata(tiny))
    expected = allocation.split_budget(2.0, [0.02, 0.001], allocation.LAYER_STRENGTH)
    assert expected[0] > 2.0 > expected[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncalibratedRatiosWarning)  # measured for this model: nothing to warn of
        for kwargs in ({}, {"ratios": "auto"}):
            hqekv.patch_model(tiny, 2.0, **kwargs)
            config = hqekv.patch_config(tiny)
            hqekv.unpatch_model(tiny)
            assert config.layer_bits == pytest.approx(expected) and config.bavg == 2.0
            assert "layer profile" in config.ratios_source and str(own_artifacts) in config.ratios_source
    hqekv.patch_model(tiny, 2.0, ratios="auto", layer_bits="shared")  # one budget, the profile set aside
    config = hqekv.patch_config(tiny)
    hqekv.unpatch_model(tiny)
    assert config.layer_bits is None and "share" in config.ratios_source
    from hqekv.eval import parse_method

    with parse_method("shared:2").applied(tiny) as config:
        assert config.layer_bits is None and config.allocation == "rate-distortion"
    with parse_method("auto:2").applied(tiny) as config:
        assert config.layer_bits == pytest.approx(expected)
    with pytest.raises(ValueError, match="pass ratios='auto'"):
        hqekv.patch_model(tiny, 2.0, layer_bits="shared")
    with pytest.raises(ValueError, match="or 'shared'"):
        hqekv.patch_model(tiny, 2.0, ratios="auto", layer_bits="split")
    assert not hqekv.is_patched(tiny)
    hqekv.patch_model(tiny, 2.0, ratios="auto", layer_bits=[1.0, 3.0])  # the user's own budgets win
    assert hqekv.patch_config(tiny).layer_bits == (1.0, 3.0)
    hqekv.unpatch_model(tiny)
    with pytest.warns(UncalibratedRatiosWarning):  # measured with other cache settings: not this cache's profile
        hqekv.patch_model(tiny, 2.0, protected_chunks=3)
    assert hqekv.patch_config(tiny).layer_bits is None
    hqekv.unpatch_model(tiny)
    other = tiny_llama(seed=0, layers=3)  # another architecture: the profile does not fit
    with pytest.warns(UncalibratedRatiosWarning):
        hqekv.patch_model(other, 2.0)
    assert hqekv.patch_config(other).layer_bits is None
    hqekv.unpatch_model(other)


def test_a_profile_of_the_wrong_length_is_an_error_not_a_guess(own_artifacts, tiny):
    profiles.save_profile(own_artifacts, [0.02, 0.001, 0.003], profile_metadata(tiny))
    with pytest.raises(ArtifactError, match="profiles 3 layers; this model compresses 2"):
        hqekv.patch_model(tiny, 2.0)
    assert not hqekv.is_patched(tiny)


def test_measure_profile_writes_what_patch_model_finds(own_artifacts, capsys):
    from hqekv import cli

    model = tiny_llama(seed=1, layers=3)
    kwargs = dict(context_tokens=320, continuation_tokens=32, segments=2, model_id="tiny/llama")
    profile = measure_profile(model, CharTokenizer(), out=own_artifacts, **kwargs)
    err = capsys.readouterr().err
    assert "prefill" in err and "3 layers, about" in err and "done in" in err
    assert profile.path == own_artifacts / "llama-layers.safetensors" and len(profile.sensitivity) == 3
    assert profile.metadata["bits"] == PROFILE_BITS and profile.metadata["segments"] == 2
    assert all(s > 0 and math.isfinite(s) for s in profile.sensitivity)
    assert measure_profile(model, CharTokenizer(), progress=False, **kwargs).sensitivity == profile.sensitivity
    hqekv.patch_model(model, 1.5)
    assert hqekv.patch_config(model).layer_bits == pytest.approx(profile.layer_bits(1.5))
    hqekv.unpatch_model(model)
    with pytest.raises(ValueError, match="below 16 bits"):
        measure_profile(model, CharTokenizer(), bits=16.0, **kwargs)
    assert cli.main(["calibrate", "--model", "smollm2"]) == 2  # neither --bavg nor --profile, before any load
    assert "--profile" in capsys.readouterr().err


def test_cli_info_and_push_take_profiles_beside_artifacts(tmp_path, tiny, monkeypatch, capsys):
    import huggingface_hub

    from hqekv import cli

    path = profiles.save_profile(tmp_path, [0.02, 0.001], profile_metadata(tiny))
    ratios = save_artifact(tmp_path, hqekv.TierRatios(int4=0.5, int2=0.5), metadata(tiny, bavg=3.0))
    assert cli.main(["info", "--json", str(tmp_path)]) == 0
    records = {r["path"]: r for r in json.loads(capsys.readouterr().out)}
    assert records[str(path)]["layer_sensitivity"] == [0.02, 0.001] and records[str(ratios)]["bavg"] == 3.0
    assert cli.main(["info", str(path)]) == 0
    assert "per-layer budgets at bavg 2" in capsys.readouterr().out
    uploads = {}

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, **kw):
            pass

        def upload_file(self, path_or_fileobj, path_in_repo, repo_id):
            uploads[path_in_repo] = path_or_fileobj if isinstance(path_or_fileobj, bytes) else open(path_or_fileobj, "rb").read()

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    assert cli.main(["push", str(ratios), str(path), "--repo", "me/tiny-hqekv", "--token", "t"]) == 0
    assert uploads[path.name] == path.read_bytes() and uploads[ratios.name] == ratios.read_bytes()
    assert "Layer profile of `tiny/llama`" in uploads["README.md"].decode()
    path.write_bytes(b"junk")
    assert cli.main(["push", str(path), "--repo", "me/tiny-hqekv"]) == 2  # refused before anything uploads

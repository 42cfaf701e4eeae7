import json
import warnings

import pytest
import torch

import hqekv
from hqekv import artifacts
from hqekv.allocation import ratio_bits
from hqekv.artifacts import ArtifactError, load_artifact, model_fingerprint, save_artifact
from hqekv.calibration import ratios_from_free
from hqekv.cli import main

from .helpers import metadata, tiny_llama

RATIOS = ratios_from_free(2.0, 0.25, 0.1)


@pytest.fixture
def model():
    return tiny_llama()


@pytest.fixture
def saved(tmp_path, model):
    return save_artifact(tmp_path, RATIOS, metadata(model))


def test_round_trip(saved, model):
    a = load_artifact(saved)
    assert saved.name == "llama-bavg2.safetensors"
    assert a.ratios == RATIOS and a.bavg == 2.0
    assert a.fingerprint == model_fingerprint(model)
    assert a.metadata["trials"] == 200 and a.metadata["format_version"] == artifacts.FORMAT_VERSION


def test_artifacts_are_written_readable_by_all_and_whole(tmp_path, model, monkeypatch):
    """safetensors' save_file creates owner-only files (0600): an artifact calibrated by one
    user (a container built as root) was unreadable by the one serving it. And a write cut
    short must leave the artifact that was there, not a truncated file patch_model finds."""
    path = save_artifact(tmp_path, RATIOS, metadata(model))
    assert path.stat().st_mode & 0o777 == 0o644
    before = path.read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_artifact(tmp_path, RATIOS, metadata(model))
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


KEY_RATIOS = hqekv.TierRatios(int4=0.7, int2=0.1, int1=0.1, evict=0.1)
VALUE_RATIOS = hqekv.TierRatios(int4=0.2, int2=0.5, int1=0.2, evict=0.1)  # bavg (3.1 + 2.0) / 2


def test_key_ratios_round_trip_and_reach_the_cache(tmp_path, model):
    path = save_artifact(tmp_path, VALUE_RATIOS, metadata(model, bavg=2.55), key_ratios=KEY_RATIOS)
    a = load_artifact(path)
    assert a.ratios == VALUE_RATIOS and a.key_ratios == KEY_RATIOS and a.bavg == 2.55
    assert "key ratios" in a.describe()
    hqekv.patch_model(model, artifact=path)
    config = hqekv.patch_config(model)
    assert config.key_ratios == KEY_RATIOS and config.ratios == VALUE_RATIOS and config.bavg == 2.55
    with torch.no_grad():
        out = model.generate(torch.randint(1, 128, (1, 400)), max_new_tokens=70, do_sample=False,
                             return_dict_in_generate=True)  # fmt: skip
    counts = hqekv.memory_report(hqekv.patching.output_cache(out)).chunks
    assert counts["k.int4"] > counts["v.int4"] and counts["v.int2"] > counts["k.int2"]
    hqekv.unpatch_model(model)


def test_artifact_key_ratios_are_validated(tmp_path, model):
    with pytest.raises(ArtifactError, match="evict"):
        save_artifact(tmp_path, VALUE_RATIOS, metadata(model, bavg=2.55), key_ratios=hqekv.TierRatios(int4=0.5, int2=0.5))
    with pytest.raises(ArtifactError, match="bavg"):
        save_artifact(tmp_path, VALUE_RATIOS, metadata(model, bavg=2.0), key_ratios=KEY_RATIOS)
    path = save_artifact(tmp_path, VALUE_RATIOS, metadata(model, bavg=2.55), key_ratios=KEY_RATIOS)
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        raw, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["key_ratios"] = torch.tensor([0.0, 0.6, 0.2, 0.1, 0.1], dtype=torch.float64)  # metadata says otherwise
    save_file(tensors, str(path), metadata=raw)
    with pytest.raises(ArtifactError, match="key_ratios tensor"):
        load_artifact(path)


def test_ratios_apply_in_either_basis(tmp_path, model):
    """The rotation is not a matched setting: ratios are shares of chunks, valid rotated or not."""
    meta = metadata(model)
    del meta["rotation"]  # searched unrotated, as every artifact before the rotation
    path = save_artifact(tmp_path, RATIOS, meta)
    for rotation in (None, "hadamard"):
        hqekv.patch_model(model, artifact=path, rotation=rotation)
        config = hqekv.patch_config(model)
        assert config.ratios == RATIOS and config.rotation == rotation
        hqekv.unpatch_model(model)


def test_fingerprint_follows_the_architecture_only(model):
    assert model_fingerprint(model) == model_fingerprint(tiny_llama(seed=5))  # same shapes, other weights
    assert model_fingerprint(model) != model_fingerprint(tiny_llama(layers=3))
    assert model_fingerprint(model) == model_fingerprint(model.config)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ArtifactError, match="not found"):
        load_artifact(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "header", "ratio-bytes"])
def test_corrupted_file_is_a_clear_error(saved, damage):
    data = bytearray(saved.read_bytes())
    if damage == "truncate":
        data = data[:-8]
    elif damage == "garbage":
        data = bytearray(b"not a safetensors file at all")
    elif damage == "header":
        data[10] ^= 0xFF
    else:  # a flipped byte in the float64 ratios, past the header
        data[-3] ^= 0x01
    saved.write_bytes(bytes(data))
    with pytest.raises(ArtifactError):
        load_artifact(saved)


def test_not_an_hqekv_artifact(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"ratios": torch.zeros(5, dtype=torch.float64)}, str(path), metadata={"format": json.dumps("x")})
    with pytest.raises(ArtifactError, match="not an hqekv"):
        load_artifact(path)


def test_save_refuses_inconsistent_metadata(tmp_path, model):
    with pytest.raises(ArtifactError, match="bavg"):
        save_artifact(tmp_path, RATIOS, metadata(model, bavg=3.2))
    meta = metadata(model)
    del meta["calibration_data_sha256"]
    with pytest.raises(ArtifactError, match="lacks"):
        save_artifact(tmp_path, RATIOS, meta)


def test_patch_model_loads_a_file_and_takes_its_bavg(saved, model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hqekv.patch_model(model, artifact=saved)
    config = hqekv.patch_config(model)
    assert config.ratios == RATIOS and config.bavg == 2.0 and config.ratios_source == f"artifact:{saved}"


def test_patch_model_rejects_wrong_model_bavg_and_settings(saved):
    with pytest.raises(ArtifactError, match="calibrated for 'tiny/llama'"):
        hqekv.patch_model(tiny_llama(layers=3), artifact=saved)
    with pytest.raises(ArtifactError, match="not bavg=3.2"):
        hqekv.patch_model(tiny_llama(), 3.2, artifact=saved)
    with pytest.raises(ArtifactError, match="window: artifact 20 vs 16"):
        hqekv.patch_model(tiny_llama(), artifact=saved, window=16)
    with pytest.raises(ValueError, match="not both"):
        hqekv.patch_model(tiny_llama(), artifact=saved, ratios=RATIOS)
    model = tiny_llama()
    with pytest.raises(ArtifactError, match="no such file"):
        hqekv.patch_model(model, artifact="/does/not/exist.safetensors")
    assert not hqekv.is_patched(model)


def test_directory_picks_the_bavg(tmp_path, model):
    r32 = ratios_from_free(3.2, 0.05, 0.05)
    save_artifact(tmp_path, RATIOS, metadata(model))
    save_artifact(tmp_path, r32, metadata(model, bavg=3.2))
    hqekv.patch_model(model, 3.2, artifact=tmp_path)
    assert hqekv.patch_config(model).ratios == r32
    hqekv.unpatch_model(model)
    hqekv.patch_model(model, artifact=tmp_path)  # no bavg: the default, 3.2
    assert hqekv.patch_config(model).ratios == r32
    hqekv.unpatch_model(model)
    with pytest.raises(ArtifactError, match="bavg=2.8.*tiny/llama bavg=2"):
        hqekv.patch_model(model, 2.8, artifact=tmp_path)


def test_hub_repo_id_resolves_offline_from_the_hub_cache(tmp_path, model, monkeypatch):
    import huggingface_hub.constants as hub

    commit = "a" * 40
    repo = tmp_path / "hub" / "models--someone--tiny-hqekv"
    snapshot = repo / "snapshots" / commit
    save_artifact(snapshot, RATIOS, metadata(model))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hqekv.patch_model(model, 2.0, artifact="someone/tiny-hqekv")
    assert hqekv.patch_config(model).ratios == RATIOS
    hqekv.unpatch_model(model)
    with pytest.raises(ArtifactError, match="Hub repo 'someone/absent'"):
        hqekv.patch_model(model, 2.0, artifact="someone/absent")


def test_shipped_artifacts_resolve_without_arguments(tmp_path, model, monkeypatch):
    monkeypatch.setattr(artifacts, "SHIPPED_DIR", tmp_path)
    save_artifact(tmp_path, RATIOS, metadata(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hqekv.patch_model(model, 2.0)
    assert hqekv.patch_config(model).ratios == RATIOS
    assert hqekv.patch_config(model).ratios_source == "shipped:llama-bavg2.safetensors"
    hqekv.unpatch_model(model)
    with pytest.warns(hqekv.UncalibratedRatiosWarning):  # another bavg: nothing shipped
        hqekv.patch_model(model, 2.8)
    hqekv.unpatch_model(model)
    with pytest.warns(hqekv.UncalibratedRatiosWarning):  # other settings: the shipped ratios do not apply
        hqekv.patch_model(model, 2.0, chunk_size=64, rerank_interval=64)


def test_a_superseded_shipped_artifact_gives_way_to_the_allocator_at_its_bytes(tmp_path, model, monkeypatch):
    monkeypatch.setattr(artifacts, "SHIPPED_DIR", tmp_path)
    path = save_artifact(tmp_path, RATIOS, metadata(model))
    monkeypatch.setattr(artifacts, "SUPERSEDED", (path.name,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the artifact was found: no UncalibratedRatiosWarning
        hqekv.patch_model(model, 2.0)
    config = hqekv.patch_config(model)
    hqekv.unpatch_model(model)
    shares = hqekv.HqeKVConfig(ratios=RATIOS, bavg=2.0, value_group=config.value_group)
    bits = ratio_bits(shares, model.config.head_dim, model.dtype)
    assert config.allocation == "rate-distortion" and config.bavg == pytest.approx(bits)
    assert bits > 2.0  # the shares name code bits; their metadata costs more
    assert config.ratios_source == f"rate-distortion at the bytes of shipped:{path.name}"

    hqekv.patch_model(model, 2.0, ratios="calibrated")  # the artifact itself, superseded or not
    config = hqekv.patch_config(model)
    hqekv.unpatch_model(model)
    assert config.ratios == RATIOS and config.allocation == "ratios" and config.ratios_source == f"shipped:{path.name}"
    assert load_artifact(path).superseded and "superseded: patch_model runs" in load_artifact(path).describe()
    copy = save_artifact(tmp_path / "elsewhere", RATIOS, metadata(model))  # the same file name, not the shipped one
    assert copy.name == path.name and not load_artifact(copy).superseded


def test_a_superseded_artifact_that_measured_its_layers_splits_the_allocator_s_budget_by_them(tmp_path, model, monkeypatch):
    from hqekv.calibration import split_budget

    monkeypatch.setattr(artifacts, "SHIPPED_DIR", tmp_path)
    sensitivity = [0.004, 0.0001]  # the first layer 40 times as sensitive
    path = save_artifact(tmp_path, RATIOS, metadata(model, layer_sensitivity=sensitivity))
    monkeypatch.setattr(artifacts, "SUPERSEDED", (path.name,))
    hqekv.patch_model(model, 2.0)
    config = hqekv.patch_config(model)
    hqekv.unpatch_model(model)
    bits = ratio_bits(hqekv.HqeKVConfig(ratios=RATIOS, bavg=2.0, value_group=config.value_group), model.config.head_dim,
                      model.dtype)  # fmt: skip
    assert config.allocation == "rate-distortion" and config.bavg == pytest.approx(bits)
    assert config.layer_bits == pytest.approx(split_budget(bits, sensitivity, hqekv.allocation.LAYER_STRENGTH))
    assert config.layer_bits[0] > bits > config.layer_bits[1]
    assert config.ratios_source == f"rate-distortion at the bytes of shipped:{path.name}, split over its layers by their sensitivity"
    assert "spend, each layer at a budget split by layer_sensitivity;" in load_artifact(path).describe()
    from hqekv import profiles

    profile = [0.0001, 0.004]  # a layer profile says the opposite: the artifact's own split, measured with it, wins
    meta = {k: v for k, v in metadata(model).items() if k not in ("bavg", "alpha", "beta", "trials", "best_loss")}
    profiles.save_profile(tmp_path, profile, {**meta, "bits": 1.0})
    hqekv.patch_model(model, 2.0)
    assert hqekv.patch_config(model).layer_bits == pytest.approx(config.layer_bits)
    hqekv.unpatch_model(model)
    save_artifact(path, RATIOS, metadata(model))  # superseded without sensitivities: the profile splits
    hqekv.patch_model(model, 2.0)
    assert hqekv.patch_config(model).layer_bits == pytest.approx(split_budget(bits, profile, hqekv.allocation.LAYER_STRENGTH))
    assert "layer profile" in hqekv.patch_config(model).ratios_source
    hqekv.unpatch_model(model)
    monkeypatch.setattr(artifacts, "SUPERSEDED", ())  # not superseded: the artifact's own shares
    hqekv.patch_model(model, 2.0)
    assert hqekv.patch_config(model).layer_bits is None and hqekv.patch_config(model).ratios == RATIOS
    hqekv.unpatch_model(model)


def test_cli_info_on_a_model_names_its_superseded_artifacts(tmp_path, model, monkeypatch, capsys):
    monkeypatch.setattr(artifacts, "SHIPPED_DIR", tmp_path / "shipped")
    path = save_artifact(tmp_path / "shipped", RATIOS, metadata(model))
    model.config.save_pretrained(tmp_path / "model")
    assert main(["info", "--model", str(tmp_path / "model"), "--json"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["shipped_artifacts"] == [path.name] and record["superseded_artifacts"] == []
    monkeypatch.setattr(artifacts, "SUPERSEDED", (path.name,))
    assert main(["info", "--model", str(tmp_path / "model")]) == 0
    assert f"shipped artifacts: {path.name} (superseded: the allocator runs at its bytes)" in capsys.readouterr().out


def test_cli_info_says_why_a_model_is_not_supported(tmp_path, capsys):
    """Not only by its model type: an attention feature patch_model refuses makes it unsupported too."""
    from .helpers import tiny_model

    config = tiny_model("gemma3_text").config
    config.save_pretrained(tmp_path / "plain")
    config.attn_logit_softcapping = 50.0
    config.save_pretrained(tmp_path / "capped")
    assert main(["info", "--model", str(tmp_path / "plain"), "--json"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["supported"] and record["unsupported_because"] is None
    assert main(["info", "--model", str(tmp_path / "capped")]) == 0
    assert "supported by hqekv: False (gemma3_text: attention logit soft-capping is not supported" in capsys.readouterr().out


def test_calibrated_ratios_insist_on_an_artifact(tmp_path, model, monkeypatch, own_artifacts):
    monkeypatch.setattr(artifacts, "SHIPPED_DIR", tmp_path)
    with pytest.raises(ArtifactError, match=r"ratios='calibrated': no calibrated artifact .* at bavg=2 .*ratios='auto'"):
        hqekv.patch_model(model, 2.0, ratios="calibrated")
    with pytest.raises(ValueError, match="takes an artifact's shares"):
        hqekv.patch_model(model, 2.0, ratios="calibrated", layer_ratios=[RATIOS, RATIOS])
    assert not hqekv.is_patched(model)
    save_artifact(own_artifacts, RATIOS, metadata(model))  # one of the user's own
    hqekv.patch_model(model, 2.0, ratios="calibrated")
    assert hqekv.patch_config(model).ratios == RATIOS
    hqekv.unpatch_model(model)


def test_shipped_artifacts_are_valid():
    for path in artifacts.shipped_artifacts():
        a = load_artifact(path)
        report = json.loads(artifacts.report_path(path).read_text())
        completed = [h for h in report["history"] if h["state"] == "COMPLETE"]
        assert a.metadata["trials"] >= 40 and len(completed) == a.metadata["trials"]
        assert a.metadata["kl_scale"] == "log" and a.metadata["value_group"] == 64


def test_shipped_profiles_are_valid_and_each_fits_a_shipped_model():
    from hqekv import profiles

    shipped = profiles.shipped_profiles()
    assert shipped, "no layer profile ships"
    fingerprints = {load_artifact(p).fingerprint for p in artifacts.shipped_artifacts()}
    for profile in shipped:
        assert profile.fingerprint in fingerprints and profile.metadata["bits"] == 1.0
        assert profile.metadata["segments"] == 4 and profile.metadata["value_group"] == 64
        assert min(profile.sensitivity) > 0 and max(profile.sensitivity) > 5 * min(profile.sensitivity)


def test_cli_info(saved, capsys):
    assert main(["info", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "tiny/llama" in out and "bavg" in out and "int2=" in out
    assert main(["info", "--json", str(saved.parent)]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["bavg"] == 2.0 and record["ratios"] == list(RATIOS.as_tuple())


def test_cli_info_reports_a_corrupt_file(saved, capsys):
    saved.write_bytes(b"junk")
    assert main(["info", str(saved)]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err


def test_push_uploads_artifact_report_and_card(saved, monkeypatch):
    import huggingface_hub

    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id, kw.get("exist_ok")))

        def upload_file(self, path_or_fileobj, path_in_repo, repo_id):
            data = path_or_fileobj if isinstance(path_or_fileobj, bytes) else open(path_or_fileobj, "rb").read()
            calls.append(("upload", path_in_repo, repo_id, data))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    artifacts.report_path(saved).write_text("{}")
    assert main(["push", str(saved), "--repo", "me/tiny-hqekv", "--token", "t"]) == 0
    assert calls[0] == ("init", "t") and calls[1] == ("create_repo", "me/tiny-hqekv", True)
    uploads = {c[1]: c[3] for c in calls if c[0] == "upload"}
    assert uploads[saved.name] == saved.read_bytes()
    assert set(uploads) == {saved.name, "llama-bavg2.report.json", "README.md"}
    card = uploads["README.md"].decode()
    assert "tiny/llama" in card and "calibration_data_sha256" in card and 'artifact="me/tiny-hqekv"' in card


def test_push_refuses_a_corrupt_artifact(saved):
    saved.write_bytes(b"junk")
    with pytest.raises(ArtifactError):
        artifacts.push_artifacts([saved], "me/x")


def _rewrite_metadata(path, **changes):
    """The artifact at ``path`` with metadata fields replaced (JSON values), tensors kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        raw, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    raw.update({k: json.dumps(v) for k, v in changes.items()})
    save_file(tensors, str(path), metadata=raw)


@pytest.mark.parametrize(
    "field,value",
    [("config_fingerprint", 12345), ("bavg", float("nan")), ("chunk_size", "32"), ("trials", -1), ("alpha", None)],
)
def test_every_metadata_field_is_validated(saved, field, value, capsys):
    _rewrite_metadata(saved, **{field: value})
    with pytest.raises(ArtifactError, match=f"invalid metadata: {field}="):
        load_artifact(saved)
    assert main(["info", str(saved)]) == 2  # `hqekv info` no longer passes it with exit 0
    assert "invalid metadata" in capsys.readouterr().err


def test_an_unreadable_file_beside_a_valid_one_is_skipped_with_a_warning(tmp_path, model):
    save_artifact(tmp_path, RATIOS, metadata(model))
    partial = tmp_path / "llama-bavg3.2.safetensors"
    partial.write_bytes(b"\x00\x01 partial download")
    with pytest.warns(artifacts.ArtifactWarning, match="llama-bavg3.2.safetensors"):
        hqekv.patch_model(model, bavg=2.0, artifact=tmp_path, value_group=64)
    assert hqekv.patch_config(model).ratios == RATIOS


def test_a_missing_relative_path_is_not_reported_as_a_hub_download(model):
    with pytest.raises(ArtifactError, match="no such file or directory"):
        hqekv.patch_model(model, artifact="arts/x.safetensors")


def test_an_empty_artifact_path_is_an_error(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_artifact(tmp_path, RATIOS, metadata(model))  # it would be found in the current directory
    with pytest.raises(ArtifactError, match="empty path"):
        hqekv.patch_model(model, artifact="")


def test_a_directory_takes_its_only_artifacts_bavg(tmp_path, model):
    save_artifact(tmp_path, RATIOS, metadata(model))  # bavg 2, not the default 3.2
    hqekv.patch_model(model, artifact=tmp_path)
    assert hqekv.patch_config(model).bavg == 2.0
    hqekv.unpatch_model(model)
    other = ratios_from_free(2.8, 0.2, 0.1)
    save_artifact(tmp_path, other, metadata(model, bavg=2.8))
    with pytest.raises(ArtifactError, match="bavg 2, 2.8: pass bavg="):
        hqekv.patch_model(model, artifact=tmp_path)


def test_own_artifacts_are_found_by_themselves_before_the_shipped_ones(tmp_path, model, monkeypatch, own_artifacts):
    """What ``hqekv calibrate`` wrote to ``$HQEKV_CACHE/artifacts`` is used without artifact=,
    ahead of an artifact shipped for the same model."""
    monkeypatch.setattr(artifacts, "SHIPPED_DIR", tmp_path / "shipped")
    save_artifact(tmp_path / "shipped", ratios_from_free(2.0, 0.1, 0.3), metadata(model))
    own = save_artifact(own_artifacts, RATIOS, metadata(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hqekv.patch_model(model, 2.0)
    assert hqekv.patch_config(model).ratios == RATIOS
    assert hqekv.patch_config(model).ratios_source == f"artifact:{own}"
    hqekv.unpatch_model(model)
    with pytest.warns(hqekv.UncalibratedRatiosWarning, match=str(own_artifacts)):  # another bavg: not found
        hqekv.patch_model(model, 2.8)


def test_the_conventional_hub_repo_of_a_model_is_found_in_the_hub_cache_without_the_network(tmp_path, model,
                                                                                           monkeypatch):  # fmt: skip
    """A model loaded as ``someone/tiny`` finds the artifacts of ``someone/tiny-hqekv`` once
    they are in the local Hub cache; without them it says where it looked, offline."""
    import huggingface_hub.constants as hub

    assert artifacts.hub_repo("someone/tiny") == "someone/tiny-hqekv"
    assert artifacts.hub_repo(str(tmp_path)) is None and artifacts.hub_repo("") is None
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model.config._name_or_path = "someone/tiny"
    with pytest.warns(hqekv.UncalibratedRatiosWarning, match="someone/tiny-hqekv"):
        hqekv.patch_model(model, 2.0)
    hqekv.unpatch_model(model)
    commit = "b" * 40
    repo = tmp_path / "hub" / "models--someone--tiny-hqekv"
    save_artifact(repo / "snapshots" / commit, RATIOS, metadata(model))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hqekv.patch_model(model, 2.0)
    assert hqekv.patch_config(model).ratios == RATIOS
    assert "models--someone--tiny-hqekv" in hqekv.patch_config(model).ratios_source


def test_an_artifact_path_under_home_is_expanded(tmp_path, model, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    path = save_artifact(tmp_path / "mine", RATIOS, metadata(model))
    hqekv.patch_model(model, 2.0, artifact=f"~/mine/{path.name}")
    assert hqekv.patch_config(model).ratios == RATIOS
    hqekv.unpatch_model(model)
    hqekv.patch_model(model, 2.0, artifact="~/mine")
    assert hqekv.patch_config(model).ratios == RATIOS

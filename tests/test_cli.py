"""The CLI checks its arguments before it loads a model: one line, exit status 2."""

import pytest

from hqekv import cli, packaged_models

BAD = [
    (["eval", "--model", "smollm2", "--tasks", "foo", "--out", "x"], "unknown tasks"),
    (["eval", "--model", "smollm2", "--lengths", "16", "--out", "x"], "lengths >= 64"),
    (["eval", "--model", "smollm2", "--methods", "kivi:3", "--out", "x"], "kivi"),
    (["eval", "--model", "smollm2", "--samples", "0", "--out", "x"], "samples >= 1"),
    (["calibrate", "--model", "smollm2", "--bavg", "-1"], "bavg must be in"),
    (["calibrate", "--model", "smollm2", "--bavg", "0"], "bavg must be in"),
    (["calibrate", "--model", "smollm2", "--bavg", "nan"], "bavg must be finite"),
    (["calibrate", "--model", "smollm2", "--bavg", "2", "--trials", "0"], "--trials"),
    (["calibrate", "--model", "smollm2", "--bavg", "2", "--beta", "-1"], "--beta"),
    (["calibrate", "--model", "smollm2", "--bavg", "2", "--chunk-size", "0"], "chunk_size"),
    (["eval", "--model", "/nonexistent", "--out", "x"], "no such directory"),
    (["calibrate", "--model", "smollm2", "--bavg", "2", "--per-layer", "--asymmetric"], "cannot be combined"),
    (["split", "--model", "smollm2", "/nonexistent.safetensors"], "file not found"),
    (["split", "--model", "smollm2", "hqekv/artifacts"], "is a directory: give one artifact file"),
    (["eval", "--model", "smollm2", "--gguf-file", "x.gguf", "--out", "x"], "--gguf-file does not apply"),
    (["info", "--model", "gemma3", "--gguf-file", "x.gguf"], "--gguf-file does not apply"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_arguments_fail_before_loading(argv, message, monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(packaged_models, "load_model", no_load)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_calibrate_help_states_the_bavg_range_the_check_uses(capsys):
    with pytest.raises(SystemExit):
        cli.main(["calibrate", "--help"])
    assert "(0, 16]" in capsys.readouterr().out


def test_unreachable_hub_is_one_line(monkeypatch, capsys):
    from hqekv.artifacts import shipped_artifacts

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert cli.main(["push", str(shipped_artifacts()[0]), "--repo", "someone/nothing"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hqekv push:") and "offline" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["gpt2", "owner/model"])
def test_hub_ids_are_not_mistaken_for_missing_paths(name):
    args = cli.build_parser().parse_args(["eval", "--model", name, "--out", "x"])
    cli.check_args(args)  # no error: these load from the Hub (or its cache)


def test_calibrate_writes_where_patch_model_looks_unless_told_otherwise(monkeypatch, own_artifacts):
    seen = []
    monkeypatch.setattr(cli, "_calibrate", lambda args: seen.append(args.out) or 0)
    assert cli.main(["calibrate", "--model", "smollm2", "--bavg", "2"]) == 0
    assert cli.main(["calibrate", "--model", "smollm2", "--bavg", "2", "--out", "elsewhere"]) == 0
    assert seen == [str(own_artifacts), "elsewhere"]


def test_split_refuses_a_split_or_foreign_artifact_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from hqekv.artifacts import load_artifact, save_artifact, shipped_artifacts

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the artifact was checked")

    monkeypatch.setattr(packaged_models, "load_model", no_load)
    gemma = next(p for p in shipped_artifacts() if p.name.startswith("gemma-3-270m-bavg2."))
    assert cli.main(["split", "--model", "smollm2", str(gemma)]) == 2  # another model's artifact
    err = capsys.readouterr().err
    assert "calibrated for" in err and "not for this model" in err and err.count("\n") == 1
    base = load_artifact(gemma)
    split = save_artifact(tmp_path, base.ratios, {**base.metadata, "per_layer": True},
                          layer_ratios=[base.ratios] * 3)  # fmt: skip
    assert cli.main(["split", "--model", "gemma3", str(split)]) == 2
    assert "already splits its ratios" in capsys.readouterr().err

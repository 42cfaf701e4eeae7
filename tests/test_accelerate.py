"""The accelerate launchers in examples/accelerate, on 2 CPU processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hqekv.artifacts import load_artifact

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def launch(processes: int, script: str, *args: str) -> None:
    """Run examples/accelerate/SCRIPT under ``accelerate launch`` on CPU workers (plainly for 1 process)."""
    path = str(ROOT / "examples" / "accelerate" / script)
    if processes == 1:
        command = [sys.executable, path, *args]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", path, *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env, cwd=ROOT, timeout=900)


def test_eval_two_cpu_processes_equal_one(tmp_path):
    # needle alone: the perplexity records of shards are checked in process (tests/eval, shards merge)
    common = ["--model", "smollm2", "--methods", "fp16", "hqekv:2", "--tasks", "needle",
              "--samples", "2", "--lengths", "256", "--no-progress"]
    launch(2, "eval.py", *common, "--out", str(tmp_path / "two"))
    launch(1, "eval.py", *common, "--out", str(tmp_path / "one"))
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    assert two["settings"]["processes"] == 2 and one["settings"]["processes"] == 1
    fields = ("task", "method", "index", "sample", "score", "cache_bytes", "prediction")
    assert [[r.get(f) for f in fields] for r in two["records"]] == [[r.get(f) for f in fields] for r in one["records"]]
    assert [(r["method"], r["score"]) for r in two["summary"]] == [(r["method"], r["score"]) for r in one["summary"]]


def test_calibration_workers_share_one_study(tmp_path):
    import optuna

    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    launch(2, "calibrate.py", "--model", "smollm2", "--bavg", "2", "--trials", "6", "--context-tokens", "256",
           "--continuation-tokens", "32", "--storage", storage, "--out", str(tmp_path / "out"), "--no-progress")
    (path,) = sorted((tmp_path / "out").glob("*.safetensors"))
    artifact = load_artifact(path)
    (summary,) = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    done = [t for t in study.get_trials() if t.state.name == "COMPLETE"]
    assert len(done) >= 6 and artifact.metadata["trials"] == len(done)
    assert artifact.metadata["best_loss"] == min(t.value for t in done)
    points = {(t.params["x3"], t.params["x4"]) for t in done}
    assert len(points) == len(done), "workers must not repeat each other's samples (differently seeded samplers)"

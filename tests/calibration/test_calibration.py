import math

import pytest
import torch

import hqekv
from hqekv import FP16_RATIOS, uncalibrated_ratios
from hqekv.artifacts import load_artifact
from hqekv.calibration import (
    LAYER_STRENGTHS,
    CompressionObjective,
    calibrate,
    calibration_cost,
    context_length,
    data_term,
    ratios_from_free,
    split_ratios_from_free,
    reference_style_kl,
    run_study,
    search_box,
)

from ..helpers import CharTokenizer, tiny_llama, tiny_objective


@pytest.mark.parametrize("bavg", [0.5, 1.0, 2.0, 2.8, 3.2, 3.25, 3.9])
def test_closed_form_satisfies_eq6_and_rejects_infeasible(bavg):
    hi3, hi4 = search_box(bavg)
    feasible = 0
    for x3 in torch.linspace(0, hi3, 9).tolist():
        for x4 in torch.linspace(0, hi4, 9).tolist():
            r = ratios_from_free(bavg, x3, x4)
            d1 = (bavg - 2 + x3 + 2 * x4) / 2
            d2 = (4 - bavg - 3 * x3 - 4 * x4) / 2
            if d1 < 0 or d2 < 0:
                assert r is None
                continue
            feasible += 1
            assert math.isclose(4 * r.int4 + 2 * r.int2 + r.int1, bavg, abs_tol=1e-9)
            assert math.isclose(sum(r.as_tuple()), 1.0, abs_tol=1e-9)
            assert (r.int1, r.evict) == (x3, x4) and r.fp16 == 0
    assert feasible > 0


@pytest.mark.parametrize("bavg", [4.0, 6.0, 0.0, float("nan")])
def test_search_box_rejects_bavg_outside_the_search(bavg):
    with pytest.raises(ValueError):
        search_box(bavg)


@pytest.fixture(scope="module")
def objective_setup():
    return tiny_objective(layers=2)


def test_objective_is_zero_for_fp16_and_positive_when_compressed(objective_setup):
    model, _, _, objective = objective_setup
    assert objective.kl(FP16_RATIOS) == 0.0
    assert objective.kl(uncalibrated_ratios(1.0)) > 0
    assert not hqekv.is_patched(model), "the objective must leave the model unpatched"


@pytest.mark.parametrize(
    "ratios",
    [uncalibrated_ratios(2.0), ratios_from_free(2.0, 0.3, 0.2), ratios_from_free(3.2, 0.1, 0.1), uncalibrated_ratios(0.5)],
    ids=["all-2bit", "b2-mixed", "b3.2-mixed", "b0.5-evict"],
)
def test_fast_objective_equals_a_full_compressed_prefill(objective_setup, ratios):
    """Faithful: the prepared objective scores what a real patched prefill of the context would."""
    model, context, continuation, objective = objective_setup
    fast = objective.kl(ratios)
    full = reference_style_kl(model, context, continuation, ratios)
    assert fast > 0
    assert math.isclose(fast, full, rel_tol=1e-5, abs_tol=1e-9), (fast, full)


def test_compressed_cache_holds_the_assigned_tiers(objective_setup):
    _, _, _, objective = objective_setup
    ratios = ratios_from_free(2.0, 0.3, 0.2)
    cache = objective.compressed_cache(ratios)
    for layer, (k_tier, _) in zip(cache.layers, objective.tiers(ratios)):
        n_evicted = int((k_tier == hqekv.tiers.EVICTED).sum())
        assert n_evicted > 0
        assert int(layer.counters.n_evicted) == n_evicted
        assert layer.table.chunk_pos.shape[1] == objective.n_chunks - n_evicted
        assert layer.get_seq_length() == 300  # logical length: evicted tokens still count


def test_objective_rejects_a_patched_model_and_bad_inputs():
    model = tiny_llama()
    with pytest.raises(ValueError, match="at least"):
        CompressionObjective(model, torch.ones(1, 10, dtype=torch.long), torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="one sequence"):
        CompressionObjective(model, torch.ones(2, 100, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="unknown cache settings"):
        CompressionObjective(model, torch.ones(1, 100, dtype=torch.long), torch.ones(1, 4, dtype=torch.long), foo=1)
    hqekv.patch_model(model, ratios=FP16_RATIOS)
    with pytest.raises(ValueError, match="unpatch"):
        CompressionObjective(model, torch.ones(1, 100, dtype=torch.long), torch.ones(1, 4, dtype=torch.long))


def test_calibrate_end_to_end_then_resume(tmp_path):
    model = tiny_llama(seed=1, layers=2)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    kwargs = dict(storage=storage, out=tmp_path, context_tokens=320, continuation_tokens=32, progress=False, model_id="tiny/llama")
    first = calibrate(model, CharTokenizer(), 2.0, trials=20, asymmetric=True, **kwargs)
    assert first.trials == 20
    k, v = first.key_ratios, first.ratios  # keys and values searched apart, one budget
    assert math.isclose((k.bavg + v.bavg) / 2, 2.0, abs_tol=1e-9) and min(k.as_tuple() + v.as_tuple()) >= 0
    assert k.evict == v.evict, "one evicted set"
    completed = [h for h in first.history if h["state"] == "COMPLETE"]
    assert len(completed) == 20
    assert first.best_loss == min(h["loss"] for h in completed)
    for h in completed:  # the mean ln KL of the 4 segments, plus the regulariser
        assert len(h["kls"]) == 4 and math.isclose(h["kl"], sum(h["kls"]) / 4)
        penalty = 2 * (h["x3k"] + h["x3v"]) / 2 + 4 * h["x4"]
        assert math.isclose(h["loss"], sum(math.log(max(k, 1e-9)) for k in h["kls"]) / 4 + penalty)
    assert len({round(h["shift"], 6) for h in completed}) > 1, "the key/value split is searched"
    assert all(split_ratios_from_free(2.0, h["shift"], h["u3k"], h["u3v"], h["x4"]) is None
               for h in first.history if h["state"] == "PRUNED"), "only infeasible samples are pruned"

    artifact = load_artifact(first.path)
    assert artifact.ratios == first.ratios and artifact.key_ratios == first.key_ratios
    assert artifact.metadata["asymmetric"] is True and artifact.metadata["rotation"] is None  # searched unrotated
    assert "asymmetric" in artifact.metadata["study_name"]
    meta = artifact.metadata
    assert meta["model_id"] == "tiny/llama" and meta["bavg"] == 2.0 and meta["trials"] == 20
    assert (meta["chunk_size"], meta["window"], meta["rerank_interval"], meta["alpha"], meta["beta"]) == (32, 20, 32, 2.0, 4.0)
    assert meta["context_tokens"] == 320 and meta["segments"] == 4 and len(meta["calibration_data_sha256"]) == 64
    assert "SQuAD" in meta["calibration_data"]
    assert (tmp_path / first.path.name.replace(".safetensors", ".report.json")).is_file()
    assert (tmp_path / first.path.name.replace(".safetensors", ".history.png")).is_file()

    hqekv.patch_model(model, artifact=first.path)
    config = hqekv.patch_config(model)
    assert config.ratios == first.ratios and config.key_ratios == first.key_ratios
    assert config.bavg == 2.0 and config.ratios_source.startswith("artifact:")
    out = model.generate(torch.randint(1, 128, (1, 100)), max_new_tokens=40, do_sample=False)
    assert out.shape == (1, 140)
    hqekv.unpatch_model(model)

    again = calibrate(model, CharTokenizer(), 2.0, trials=25, asymmetric=True, **kwargs)
    assert again.trials == 25
    prefix = [(h["shift"], h["x4"], h["loss"]) for h in again.history[: len(first.history)]]
    assert prefix == [(h["shift"], h["x4"], h["loss"]) for h in first.history], "a re-run continues the same study"


def test_symmetric_calibration_is_the_papers_search(tmp_path):
    """asymmetric=False (the default): the paper's two variables (δ3, δ4), one set of ratios for keys and values."""
    model = tiny_llama(seed=1, layers=2)
    result = calibrate(model, CharTokenizer(), 2.0, trials=6, out=tmp_path, context_tokens=320, continuation_tokens=32,
                       progress=False, model_id="tiny/llama", rotation="hadamard")  # fmt: skip
    r = result.ratios
    assert result.key_ratios is None
    assert math.isclose(4 * r.int4 + 2 * r.int2 + r.int1, 2.0, abs_tol=1e-9) and min(r.as_tuple()) >= 0
    completed = [h for h in result.history if h["state"] == "COMPLETE"]
    assert all("shift" not in h and ratios_from_free(2.0, h["x3"], h["x4"]) is not None for h in completed)
    artifact = load_artifact(result.path)
    assert artifact.key_ratios is None and artifact.metadata["asymmetric"] is False
    assert "asymmetric" not in artifact.metadata["study_name"] and "rotation=hadamard" in artifact.metadata["study_name"]
    assert artifact.metadata["rotation"] == "hadamard"


def test_calibrate_rejects_bad_bavg_before_any_work():
    with pytest.raises(ValueError, match="0 < bavg < 4"):
        calibrate(tiny_llama(), CharTokenizer(), [2.0, 5.0], trials=1)
    with pytest.raises(ValueError, match="trials"):
        from hqekv.calibration import run_study

        run_study(None, 2.0, trials=0)


def test_study_refuses_another_bavg(tmp_path, objective_setup):
    from hqekv.calibration import run_study

    _, _, _, objective = objective_setup
    storage = f"sqlite:///{tmp_path / 's.db'}"
    run_study(objective, 2.0, trials=2, storage=storage, name="same", progress=False)
    with pytest.raises(ValueError, match="bavg=2"):
        run_study(objective, 3.2, trials=2, storage=storage, name="same", progress=False)



class EvictionHelps:
    """A stand-in objective with the shape measured on SmolLM2 at bavg 2: the all-2-bit end has
    ten times the KL of ratios that evict a third of the chunks and keep the rest at 4 bits."""

    def kl(self, ratios, key_ratios=None):
        one_bit = ratios.int1 if key_ratios is None else (ratios.int1 + key_ratios.int1) / 2
        return 0.3 * math.exp(-8 * ratios.evict) + 0.02 * one_bit


@pytest.mark.parametrize("asymmetric", [True, False], ids=["asymmetric", "symmetric"])
@pytest.mark.parametrize("kl_scale, evicts", [("log", True), ("linear", False)])
def test_the_log_scale_lets_the_data_decide_where_the_linear_one_cannot(kl_scale, evicts, asymmetric):
    """On the KL's own scale α·δ3 + β·δ4 outweighs a tenfold KL gain; on ln KL it is a tie-breaker."""
    result = run_study(EvictionHelps(), 2.0, trials=60, kl_scale=kl_scale, progress=False, asymmetric=asymmetric)
    assert (result.ratios.evict > 0.25) is evicts, result.ratios.describe()
    keys = result.key_ratios or result.ratios
    assert (result.key_ratios is not None) is asymmetric
    one_bit = (keys.int1 + result.ratios.int1) / 2
    assert result.best_loss == pytest.approx(data_term(result.best_kl, kl_scale) + 2 * one_bit + 4 * result.ratios.evict)


def test_data_term():
    assert data_term(math.e**-3) == pytest.approx(-3.0)
    assert data_term(0.0) == math.log(1e-9)  # all-FP16 ratios: KL exactly 0
    assert data_term(0.25, "linear") == 0.25
    with pytest.raises(ValueError, match="kl_scale"):
        data_term(0.1, "square")
    with pytest.raises(ValueError, match="kl_scale"):
        run_study(EvictionHelps(), 2.0, trials=1, kl_scale="square", progress=False)


def test_context_is_capped_to_the_models_positions():
    model = tiny_llama(seed=0, layers=1)
    limit = model.config.max_position_embeddings
    assert context_length(model, None, 128) == min(16384, limit - 128)
    assert context_length(model, 100, 28) == 100
    with pytest.raises(ValueError, match="max_position_embeddings"):
        context_length(model, limit, 128)


def test_calibrate_says_what_it_will_cost_before_the_trials(tmp_path, capsys):
    model = tiny_llama(seed=1, layers=2)
    calibrate(model, CharTokenizer(), [2.0, 3.0], trials=3, out=tmp_path, context_tokens=320, continuation_tokens=32,
              model_id="tiny/llama")  # fmt: skip
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hqekv calibrate:")]
    assert "2 bavg × 3 trials" in lines[0] and "prefilled once" in lines[0]
    assert "6 trials, about" in lines[1]
    n, seconds = calibration_cost([2.0, 3.0], 3, True, 30, 10.0, 0.5)
    assert n == 2 * (3 + 30 + len(LAYER_STRENGTHS)) and seconds == 10.0 + n * 0.5

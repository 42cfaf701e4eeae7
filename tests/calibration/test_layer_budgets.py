"""Per-layer budgets: one set of tier ratios per compressed layer (config, cache, artifacts, calibration)."""

import math

import pytest
import torch

import hqekv
from hqekv import FP16_RATIOS, HqeKVConfig, TierRatios
from hqekv.artifacts import ArtifactError, load_artifact, save_artifact
from hqekv.tiers import EVICTED, FP16
from hqekv.calibration import calibrate, layer_budgets, layer_sensitivity, mean_kl, ratios_at, split_budget

from ..helpers import CharTokenizer, chunk_bytes_of, metadata, tiny_llama, tiny_objective

BASE = TierRatios(int4=0.5, int2=0.3, int1=0.1, evict=0.1)  # 2.7 bits


def layers_for(bits):
    return tuple(ratios_at(BASE, b) for b in bits)


@pytest.mark.parametrize("bits", [0.3, 1.0, 2.0, 2.7, 3.5, 4.0, 6.0, 16.0])
def test_ratios_at_gives_the_bits_asked_on_a_path_through_the_base(bits):
    r = ratios_at(BASE, bits)
    assert math.isclose(r.bavg, bits, abs_tol=1e-9) and math.isclose(sum(r.as_tuple()), 1.0, abs_tol=1e-9)
    assert min(r.as_tuple()) >= 0
    if bits < BASE.bavg:  # kept tiers shrink alike, the rest is evicted
        t = bits / BASE.bavg
        assert all(math.isclose(a, b * t) for a, b in zip(r.as_tuple()[:4], BASE.as_tuple()[:4]))
    elif bits <= 4:  # towards all 4-bit: no FP16 yet, every lower tier shrinks
        assert r.fp16 == 0 and r.int4 >= BASE.int4 and r.evict <= BASE.evict
    else:
        assert r.fp16 > 0 and r.int2 == r.int1 == r.evict == 0
    assert ratios_at(BASE, BASE.bavg) == BASE


def test_split_budget_averages_the_budget_and_follows_the_sensitivity():
    sens = [0.5, 0.01, 0.04, 0.002]
    assert split_budget(2.0, sens, 0.0) == pytest.approx([2.0] * 4)
    bits = split_budget(2.0, sens, 1.0)
    assert math.isclose(sum(bits) / 4, 2.0, abs_tol=1e-9)
    assert bits[0] > bits[2] > bits[1] > bits[3]
    # unclipped, γ = 1 is reverse water-filling: half a bit per doubling of the sensitivity
    assert math.isclose(bits[2] - bits[1], 0.5 * math.log2(4), abs_tol=1e-9)
    wide = split_budget(2.0, sens, 10.0)
    assert min(wide) == pytest.approx(0.5) and max(wide) == pytest.approx(6.0)  # clipped to [bavg/4, 3·bavg]
    assert math.isclose(sum(wide) / 4, 2.0, abs_tol=1e-9)
    with pytest.raises(ValueError, match="strength"):
        split_budget(2.0, sens, -1.0)


def test_config_validates_layer_ratios_and_gives_each_layer_its_own():
    layers = layers_for([1.7, 3.7])
    config = HqeKVConfig(ratios=BASE, bavg=2.7, layer_ratios=layers)
    assert config.for_layer(0).ratios == layers[0] and config.for_layer(1).bavg == pytest.approx(3.7)
    assert config.for_layer(1).layer_ratios is None
    assert HqeKVConfig.from_dict(config.to_dict()) == config
    assert "per-layer" in config.describe_ratios()
    with pytest.raises(ValueError, match="average"):
        HqeKVConfig(ratios=BASE, bavg=2.7, layer_ratios=layers_for([1.7, 3.0]))
    with pytest.raises(ValueError, match="cannot be combined"):
        HqeKVConfig(ratios=BASE, key_ratios=BASE, bavg=2.7, layer_ratios=layers)
    with pytest.raises(ValueError, match="empty"):
        HqeKVConfig(ratios=BASE, bavg=2.7, layer_ratios=())
    with pytest.raises(TypeError, match="sequence"):
        HqeKVConfig(ratios=BASE, bavg=2.7, layer_ratios=BASE)


@pytest.mark.filterwarnings("ignore:hqekv. this request stored")  # 400 tokens: the FP16 parts dominate
def test_patched_model_compresses_each_layer_at_its_own_ratios():
    model = tiny_llama(seed=2, layers=2)
    layers = (TierRatios(int4=1.0), TierRatios(int2=0.7, evict=0.3))  # 4 and 1.4 bits: mean 2.7
    hqekv.patch_model(model, ratios=BASE, layer_ratios=layers)
    assert hqekv.patch_config(model).bavg == pytest.approx(2.7)
    ids = torch.randint(1, 128, (1, 400), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    first, second = cache.layers
    assert first.config.ratios == layers[0] and second.config.ratios == layers[1]
    tiers = lambda layer: set(layer.table.k_tier[layer.table.chunk_pos >= 0].tolist())  # noqa: E731
    assert tiers(first) == {FP16, 1} and int(first.counters.n_evicted.sum()) == 0  # 4-bit and the protected FP16 chunks
    assert int(second.counters.n_evicted.sum()) > 0 and tiers(second) == {FP16, 2}
    report = hqekv.memory_report(cache)
    assert report.requested_bavg == pytest.approx(2.7)
    hqekv.unpatch_model(model)
    with pytest.raises(ValueError, match="2 global attention layers"):
        hqekv.patch_model(model, ratios=BASE, layer_ratios=layers_for([2.7, 2.7, 2.7]))
    with pytest.raises(ValueError, match="needs ratios"):
        hqekv.patch_model(model, layer_ratios=layers)
    assert not hqekv.is_patched(model)


def test_artifact_round_trips_layer_ratios_and_rejects_defects(tmp_path):
    model = tiny_llama(seed=2, layers=2)
    layers = layers_for([1.7, 3.7])
    path = save_artifact(tmp_path, BASE, metadata(model, bavg=2.7), layer_ratios=layers)
    artifact = load_artifact(path)
    assert artifact.layer_ratios == layers and artifact.ratios == BASE
    assert "per-layer budgets" in artifact.describe()
    hqekv.patch_model(model, artifact=path)
    assert hqekv.patch_config(model).layer_ratios == layers
    hqekv.unpatch_model(model)
    with pytest.raises(ArtifactError, match="average"):
        save_artifact(tmp_path / "b.safetensors", BASE, metadata(model, bavg=2.7), layer_ratios=layers_for([1.7, 3.0]))
    with pytest.raises(ArtifactError, match="not both"):
        save_artifact(tmp_path / "c.safetensors", BASE, metadata(model, bavg=2.7), key_ratios=BASE, layer_ratios=layers)

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["layer_ratios"] = tensors["layer_ratios"].flip(0).contiguous()  # the tensor no longer matches the metadata
    save_file(tensors, str(tmp_path / "d.safetensors"), metadata=meta)
    with pytest.raises(ArtifactError, match="disagrees"):
        load_artifact(tmp_path / "d.safetensors")
    tensors["layer_ratios"] = tensors["layer_ratios"][:, :4].contiguous()
    save_file(tensors, str(tmp_path / "e.safetensors"), metadata=meta)
    with pytest.raises(ArtifactError, match="shape"):
        load_artifact(tmp_path / "e.safetensors")


@pytest.fixture(scope="module")
def objective():
    return tiny_objective(layers=3)[3]


def test_objective_scores_per_layer_ratios_as_a_patched_prefill_would(objective):
    layers = (TierRatios(int2=1.0), FP16_RATIOS, TierRatios(int4=0.5, evict=0.5))
    tiers = objective.tiers(BASE, layer_ratios=layers)
    assert not bool((tiers[0][0] == FP16).all()) and int((tiers[0][0] == EVICTED).sum()) == 0
    assert bool((tiers[1][0] == FP16).all())
    assert int((tiers[2][0] == EVICTED).sum()) > 0
    # the same per-layer cache as a real patched prefill, to the rounding
    from hqekv.calibration.objective import _patched
    from hqekv.patching import cache_for

    mean = sum(r.bavg for r in layers) / 3
    config = HqeKVConfig(ratios=hqekv.uncalibrated_ratios(mean), bavg=mean, layer_ratios=layers)
    model = objective.model
    fast = objective.kl(BASE, layer_ratios=config.layer_ratios)
    with _patched(model, {}), torch.no_grad():
        cache = cache_for(config, model)
        model(objective.context, cache=cache, use_cache=True, logits_to_keep=1)
        logits = model(objective.continuation, cache=cache, use_cache=True).logits
    full = mean_kl(objective.reference, torch.log_softmax(logits[0].float(), -1))
    assert fast > 0 and math.isclose(fast, full, rel_tol=1e-5), (fast, full)
    with pytest.raises(ValueError, match="3 compressed layers"):
        objective.tiers(BASE, layer_ratios=layers[:2])


def test_layer_sensitivity_is_each_layer_alone(objective):
    sens = layer_sensitivity(objective, TierRatios(int2=1.0))
    assert len(sens) == 3 and all(s > 0 for s in sens)
    first_alone = (TierRatios(int2=1.0), FP16_RATIOS, FP16_RATIOS)
    assert sens[0] == objective.kl(BASE, layer_ratios=first_alone)


def test_layer_budgets_keeps_the_lowest_loss_and_one_set_when_the_split_does_not_help(objective):
    found = layer_budgets(objective, BASE, strengths=(0.5, 1.0))
    assert [row["strength"] for row in found.search] == [0.0, 0.5, 1.0]
    best = min(found.search, key=lambda row: row["loss"])
    assert found.strength == best["strength"]
    assert found.search[0]["kl"] == objective.kl(BASE)
    for row in found.search:
        assert math.isclose(sum(row["bits"]) / 3, BASE.bavg, abs_tol=1e-6)
    if found.strength == 0:
        assert found.layer_ratios is None
    else:
        assert [r.bavg for r in found.layer_ratios] == pytest.approx(best["bits"])
    # a split the loss cannot prefer: a huge penalty on eviction makes γ = 0 win
    penalised = layer_budgets(objective, BASE, strengths=(1.0,), beta=1e6)
    assert penalised.strength == 0.0 and penalised.layer_ratios is None


def test_calibrate_per_layer_writes_an_artifact_patch_model_uses(tmp_path):
    model = tiny_llama(seed=1, layers=3)
    result = calibrate(model, CharTokenizer(), 2.0, trials=4, out=tmp_path, context_tokens=320, continuation_tokens=32,
                       progress=False, model_id="tiny/llama", per_layer=True)  # fmt: skip
    meta = load_artifact(result.path).metadata
    assert meta["per_layer"] is True and len(meta["layer_sensitivity"]) == 3
    assert [row["strength"] for row in meta["layer_search"]][0] == 0.0
    assert meta["best_loss"] == min(row["loss"] for row in meta["layer_search"])
    artifact = load_artifact(result.path)
    assert artifact.layer_ratios == result.layer_ratios
    hqekv.patch_model(model, artifact=result.path)
    assert hqekv.patch_config(model).layer_ratios == result.layer_ratios
    hqekv.unpatch_model(model)
    with pytest.raises(ValueError, match="cannot be combined"):
        calibrate(model, CharTokenizer(), 2.0, trials=1, per_layer=True, asymmetric=True)


def test_eval_paper_method_uses_one_set_where_hqekv_uses_the_per_layer_budgets(tmp_path, monkeypatch):
    from hqekv import artifacts
    from hqekv.eval import parse_method

    model = tiny_llama(seed=2, layers=2)
    layers = layers_for([1.7, 3.7])
    path = save_artifact(tmp_path, BASE, metadata(model, bavg=2.7, rotation=None), layer_ratios=layers)
    monkeypatch.setattr(artifacts, "shipped_artifacts", lambda: [path])
    with parse_method("hqekv:2.7").applied(model) as config:
        assert config.layer_ratios == layers
    with parse_method("paper:2.7").applied(model) as config:
        assert config.layer_ratios is None and config.ratios == BASE and config.rotation is None
    with parse_method("rpaper:2.7").applied(model) as config:
        assert config.layer_ratios is None and config.ratios == BASE and config.rotation == "hadamard"
    with parse_method("random:2.7").applied(model) as config:
        assert config.layer_ratios == layers and config.importance == "random"
    assert not hqekv.is_patched(model)


def test_split_artifact_adds_per_layer_budgets_to_an_existing_search(tmp_path):
    from hqekv import cli
    from hqekv.calibration import split_artifact

    model = tiny_llama(seed=1, layers=3)
    kwargs = dict(context_tokens=320, continuation_tokens=32, progress=False, model_id="tiny/llama")
    searched = calibrate(model, CharTokenizer(), 2.0, trials=4, out=tmp_path / "one", **kwargs)
    together = calibrate(model, CharTokenizer(), 2.0, trials=4, per_layer=True, **kwargs)
    split = split_artifact(model, CharTokenizer(), searched.path, out=tmp_path / "split")
    # the same ratios, sensitivities and choice as the search with per_layer=True
    assert split.ratios == searched.ratios == together.ratios
    assert split.layer_ratios == together.layer_ratios
    assert split.metadata["layer_sensitivity"] == together.metadata["layer_sensitivity"]
    artifact = load_artifact(split.path)
    assert artifact.metadata["split_from"] == searched.path.name and artifact.metadata["trials"] == 4
    assert artifact.metadata["study_name"] == load_artifact(searched.path).metadata["study_name"]
    assert len(split.history) == len(searched.history)  # the report keeps the search's trials
    with pytest.raises(ArtifactError, match="already splits"):
        split_artifact(model, CharTokenizer(), split.path)
    with pytest.raises(ArtifactError, match="not for this model"):
        split_artifact(tiny_llama(seed=1, layers=2), CharTokenizer(), searched.path)
    assert cli.main(["split", "--model", "smollm2", str(split.path)]) == 2  # checked before any model loads


def test_config_validates_layer_bits_and_gives_each_layer_its_own_budget():
    config = hqekv.config.budget_config(2.0, layer_bits=[1.0, 3.0])
    assert config.layer_bits == (1.0, 3.0)
    first, second = config.for_layer(0), config.for_layer(1)
    assert (first.bavg, second.bavg) == (1.0, 3.0) and first.layer_bits is second.layer_bits is None
    assert second.allocation == "rate-distortion" and math.isclose(second.ratios.bavg, 3.0)  # sizes the reserve
    assert HqeKVConfig.from_dict(config.to_dict()) == config
    assert "2 per-layer budgets (bits 1.00, 3.00)" in config.describe_ratios()
    with pytest.raises(ValueError, match="average 2.5 bits"):
        hqekv.config.budget_config(2.0, layer_bits=[2.0, 3.0])
    with pytest.raises(ValueError, match=r"layer_bits\[0\]: bavg must be in"):
        hqekv.config.budget_config(2.0, layer_bits=[-1.0, 5.0])
    with pytest.raises(TypeError, match=r"layer_bits\[1\]"):
        hqekv.config.budget_config(2.0, layer_bits=[2.0, None])
    with pytest.raises(ValueError, match="empty"):
        hqekv.config.budget_config(2.0, layer_bits=[])
    with pytest.raises(TypeError, match="sequence"):
        hqekv.config.budget_config(2.0, layer_bits=2.0)
    with pytest.raises(ValueError, match="rate-distortion allocator"):
        HqeKVConfig(ratios=BASE, bavg=2.7, layer_bits=[2.7, 2.7])


def test_layers_at_their_own_budgets_each_hold_theirs_and_do_not_share():
    """``layer_bits``: through prefill and decode re-ranks each layer stays within its own
    budget (the model's within the mean), and the layers hold what their budgets allow."""
    from hqekv.transformers_internals import cache_for

    model = tiny_llama(seed=3, layers=3)
    hqekv.patch_model(model, 1.5, ratios="auto")
    bits = (1.0, 1.5, 2.0)
    cache = cache_for(hqekv.config.budget_config(1.5, layer_bits=bits, value_group=hqekv.patch_config(model).value_group), model)
    with pytest.raises(ValueError, match="layer_bits give 2 per-layer budgets"):
        cache_for(hqekv.config.budget_config(1.5, layer_bits=(1.0, 2.0)), model)
    ids = torch.randint(1, 128, (2, 1200), generator=torch.Generator().manual_seed(1))
    held = []

    def check(rows):  # the rows that re-ranked: between re-ranks a flushed chunk waits for the next
        held.clear()
        for layer, b in zip(cache.hqekv_layers, bits):
            elements = layer.counters.n_chunks * (2 * layer.num_kv_heads * 32 * layer.head_dim)
            assert layer.config.bavg == b and layer.pending is None
            assert (chunk_bytes_of(layer) <= b / 8 * elements + 1e-6)[rows].all()
            held.append((chunk_bytes_of(layer) / (b / 8 * elements))[rows])

    reranks = 0
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache)
        check(torch.ones(2, dtype=torch.bool))
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(100):
            before = cache.hqekv_layers[0].counters.since_rerank.clone()
            out = model(input_ids=token, cache=cache)
            token = out.logits[:, -1:].argmax(-1)
            reranked = cache.hqekv_layers[0].counters.since_rerank <= before
            check(reranked)
            reranks += int(reranked.sum())
    hqekv.unpatch_model(model)
    assert reranks >= 4
    # each layer spends most of its own budget, the 2-bit one too (a shared price could move it)
    assert all((h > 0.8).all() for h in held), held


def test_patch_model_takes_layer_bits_with_the_allocator_only():
    model = tiny_llama(seed=2, layers=2)
    hqekv.patch_model(model, 2.0, ratios="auto", layer_bits=[1.5, 2.5])
    config = hqekv.patch_config(model)
    ids = torch.randint(1, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    hqekv.unpatch_model(model)
    assert config.layer_bits == (1.5, 2.5) and config.allocation == "rate-distortion"
    hqekv.patch_model(model, ratios="auto", layer_bits=[1.0, 2.0])  # bavg: their mean
    assert hqekv.patch_config(model).bavg == 1.5
    hqekv.unpatch_model(model)
    assert [layer.config.bavg for layer in out.past_key_values.hqekv_layers] == [1.5, 2.5]
    with pytest.raises(ValueError, match="pass ratios='auto'"):
        hqekv.patch_model(model, 2.0, layer_bits=[1.5, 2.5])
    with pytest.raises(ValueError, match="3 layer_bits for a llama model with 2"):
        hqekv.patch_model(model, 2.0, ratios="auto", layer_bits=[1.5, 2.5, 2.0])
    with pytest.raises(ValueError, match="average 2.5"):
        hqekv.patch_model(model, 2.0, ratios="auto", layer_bits=[2.5, 2.5])
    with pytest.raises(TypeError, match=r"layer_bits\[1\]"):
        hqekv.patch_model(model, ratios="auto", layer_bits=[2.5, "2"])
    assert not hqekv.is_patched(model)

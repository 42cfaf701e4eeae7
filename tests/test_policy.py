import pytest
import torch

from hqekv.config import FP16_RATIOS, HqeKVConfig, TierRatios, uncalibrated_ratios
from hqekv.policy import assign_tiers, tier_counts
from hqekv.tiers import EVICTED, FP16, INT1, INT2, INT4


@pytest.mark.parametrize("bavg", [0.5, 1.0, 1.5, 2.0, 2.8, 3.2, 3.25, 4.0, 8.0, 16.0])
def test_uncalibrated_ratios_hit_bavg(bavg):
    r = uncalibrated_ratios(bavg)
    assert r.bavg == pytest.approx(bavg) and sum(r.as_tuple()) == pytest.approx(1.0)
    assert min(r.as_tuple()) >= 0


@pytest.mark.parametrize(
    "ratios", [TierRatios(int4=0.3, int2=0.3, int1=0.2, evict=0.2), uncalibrated_ratios(3.2), TierRatios(0.1, 0.2, 0.3, 0.15, 0.25)]
)
@pytest.mark.parametrize("n", [0, 1, 3, 7, 10, 33, 128, 1000])
def test_tier_counts_sum_and_within_one_chunk(ratios, n):
    counts = tier_counts(torch.tensor([n]), ratios)[0]
    assert counts.sum().item() == n and (counts >= 0).all()
    exact = [n * r for r in ratios.as_tuple()]
    for t in (FP16, INT4, INT2, EVICTED):
        assert abs(counts[t].item() - exact[t]) <= 1
    # SPEC eq. (6): the bits the counts give stay within a few chunk-bits of bavg·n
    bits = 16 * counts[FP16] + 4 * counts[INT4] + 2 * counts[INT2] + counts[INT1]
    assert abs(bits.item() - ratios.bavg * n) <= 16 + 4 + 2 + 1


def _scores(c, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(2, c, generator=g), torch.rand(2, c, generator=g)


def test_one_evicted_set_top2_fp16_and_counts():
    ratios = TierRatios(int4=0.25, int2=0.25, int1=0.25, evict=0.25)
    c = 42
    sk, sv = _scores(c, 0)
    valid = torch.ones(2, c, dtype=torch.bool)
    kt, vt = assign_tiers(sk, sv, valid, ratios)
    assert torch.equal(kt == EVICTED, vt == EVICTED)
    expected = tier_counts(torch.tensor([c - 2]), ratios)[0]
    for row in range(2):
        top_k = sk[row].topk(2).indices
        top_v = sv[row].topk(2).indices
        assert (kt[row, top_k] == FP16).all() and (vt[row, top_v] == FP16).all()
        assert (kt[row, top_v] != EVICTED).all() and (vt[row, top_k] != EVICTED).all()
        for tiers in (kt[row], vt[row]):
            got = torch.bincount(tiers, minlength=5)
            assert got[FP16] == 2 + expected[FP16]
            assert got[INT4] == expected[INT4] and got[INT2] == expected[INT2] and got[EVICTED] == expected[EVICTED]
        # K tiers follow metric_K order among kept chunks
        kept = kt[row] != EVICTED
        order = sk[row][kept].argsort(descending=True)
        assert (kt[row][kept][order].diff() >= 0).all()
        order = sv[row][kept].argsort(descending=True)
        assert (vt[row][kept][order].diff() >= 0).all()


def test_joint_eviction_keeps_sinks_and_high_range_values():
    # chunk 0: attention sink (high K score, low V score); chunk 1: high V score, low K score.
    c = 20
    sk = torch.linspace(0.5, 0.1, c)[None].clone()
    sv = torch.linspace(0.5, 0.1, c)[None].clone()
    sk[0, 5], sv[0, 5] = 10.0, 0.0  # sink-like
    sv[0, 9], sk[0, 9] = 10.0, 0.0  # high value range
    ratios = TierRatios(int2=0.5, evict=0.5)
    valid = torch.ones(1, c, dtype=torch.bool)
    kt, _ = assign_tiers(sk, sv, valid, ratios, eviction="joint")
    assert kt[0, 5] != EVICTED and kt[0, 9] != EVICTED
    # K-only ablation would drop the high-range value chunk unless protected: make it not top-2 in V
    sv2 = sv.clone()
    sv2[0, 0], sv2[0, 1] = 20.0, 19.0
    kt_key, _ = assign_tiers(sk, sv2, valid, ratios, eviction="key")
    kt_joint, _ = assign_tiers(sk, sv2, valid, ratios, eviction="joint")
    assert kt_key[0, 9] == EVICTED and kt_joint[0, 9] != EVICTED


def test_invalid_entries_and_prior_evictions():
    ratios = TierRatios(int2=0.5, evict=0.5)
    sk, sv = _scores(10, 3)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 6:] = False
    kt, vt = assign_tiers(sk, sv, valid, ratios, n_logical=torch.tensor([12, 6]), n_evicted=torch.tensor([2, 0]))
    assert (kt[1, 6:] == EVICTED).all()
    # row 0: 12 logical chunks -> 10 rankable -> 5 to evict, 2 already gone -> 3 more
    assert (kt[0] == EVICTED).sum() == 3
    assert (kt[1, :6] == EVICTED).sum() == 2


def test_all_fp16_ratios_keep_everything():
    sk, sv = _scores(9, 4)
    kt, vt = assign_tiers(sk, sv, torch.ones(2, 9, dtype=torch.bool), FP16_RATIOS)
    assert (kt == FP16).all() and (vt == FP16).all()


@pytest.mark.parametrize("bad", [0, -1, 16.5, float("nan"), float("inf"), "3", True, None])
def test_bad_bavg(bad):
    from hqekv.config import check_bavg

    with pytest.raises((ValueError, TypeError), match="bavg"):
        check_bavg(bad)


def test_bad_ratios():
    with pytest.raises(ValueError, match="sum to 1"):
        TierRatios.coerce((0.5, 0.5, 0.5, 0.0))
    with pytest.raises(ValueError, match="4 entries"):
        TierRatios.coerce((0.5, 0.5))
    with pytest.raises(ValueError, match="\\[0, 1\\]"):
        TierRatios.coerce((1.5, -0.5, 0.0, 0.0))
    with pytest.raises(ValueError, match="eq. 6"):
        HqeKVConfig(ratios=TierRatios(int4=1.0), bavg=2.0)
    with pytest.raises(ValueError, match="eviction"):
        HqeKVConfig(ratios=TierRatios(int4=1.0), bavg=4.0, eviction="random")
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        HqeKVConfig(ratios=TierRatios(int4=1.0), bavg=4.0, rerank_interval=40)


def test_config_round_trip():
    cfg = HqeKVConfig(ratios=uncalibrated_ratios(2.8), bavg=2.8, eviction="value")
    assert HqeKVConfig.from_dict(cfg.to_dict()) == cfg


def test_key_ratios_give_keys_their_own_counts_with_one_evicted_set():
    keys = TierRatios(int4=0.6, int2=0.1, int1=0.0, evict=0.3)
    values = TierRatios(int4=0.1, int2=0.5, int1=0.1, evict=0.3)
    c = 57
    sk, sv = _scores(c, 3)
    valid = torch.ones(2, c, dtype=torch.bool)
    kt, vt = assign_tiers(sk, sv, valid, values, key_ratios=keys)
    assert torch.equal(kt == EVICTED, vt == EVICTED)
    symmetric_k, symmetric_v = assign_tiers(sk, sv, valid, values)
    assert torch.equal(vt, symmetric_v), "the values' tiers do not depend on the keys' ratios"
    assert torch.equal(kt == EVICTED, symmetric_k == EVICTED), "nor does the evicted set"
    for component, ratios, tiers in (("k", keys, kt), ("v", values, vt)):
        expected = tier_counts(torch.tensor([c - 2]), ratios)[0]
        for row in range(2):
            got = torch.bincount(tiers[row], minlength=5)
            assert got[FP16] == 2 + expected[FP16], component
            assert got[INT4] == expected[INT4] and got[INT2] == expected[INT2], component


def test_config_key_ratios_are_checked_and_round_trip():
    keys = TierRatios(int4=0.8, evict=0.2)  # 3.2 bits
    values = TierRatios(int4=0.4, int2=0.4, evict=0.2)  # 2.4 bits
    cfg = HqeKVConfig(ratios=values, key_ratios=keys, bavg=2.8)
    assert cfg.k_ratios == keys and cfg.code_bavg == pytest.approx(2.8)
    assert "keys" in cfg.describe_ratios() and "values" in cfg.describe_ratios()
    assert HqeKVConfig.from_dict(cfg.to_dict()) == cfg
    assert HqeKVConfig(ratios=values, bavg=2.4).k_ratios == values
    with pytest.raises(ValueError, match="eq. 6"):
        HqeKVConfig(ratios=values, key_ratios=keys, bavg=3.2)
    with pytest.raises(ValueError, match="evicted shares must be equal"):
        HqeKVConfig(ratios=values, key_ratios=TierRatios(int4=0.6, int2=0.4), bavg=2.6)


@pytest.mark.parametrize("seed", range(5))
def test_floors_keep_tiers_down_and_give_every_place_of_a_tier_to_a_chunk_that_can_take_it(seed):
    """Chunks held low by earlier re-ranks never rise, and the places they cannot take go to
    the next best chunks: each tier holds its count, so the bytes are those of the ratios."""
    gen = torch.Generator().manual_seed(seed)
    b, c = 2, 40
    score_k, score_v = torch.rand(b, c, generator=gen), torch.rand(b, c, generator=gen)
    valid = torch.ones(b, c, dtype=torch.bool)
    floor_k = torch.randint(0, 4, (b, c), generator=gen) * (torch.rand(b, c, generator=gen) < 0.3)
    floor_v = torch.randint(0, 4, (b, c), generator=gen) * (torch.rand(b, c, generator=gen) < 0.3)
    ratios = TierRatios(int4=0.3, int2=0.3, int1=0.2, evict=0.2)
    k, v = assign_tiers(score_k, score_v, valid, ratios, fp16_k=floor_k == FP16, fp16_v=floor_v == FP16,
                        floor_k=floor_k, floor_v=floor_v)  # fmt: skip
    plain_k, _ = assign_tiers(score_k, score_v, valid, ratios, fp16_k=floor_k == FP16, fp16_v=floor_v == FP16)
    counts = tier_counts(torch.full((b,), c - 2), ratios)
    for tiers, floor in ((k, floor_k), (v, floor_v)):
        kept = tiers != EVICTED
        assert (tiers[kept] >= floor[kept]).all()
        for row in range(b):
            n_fp16 = int((floor[row][kept[row]] == FP16).sum())
            if n_fp16 >= 2 + counts[row, FP16]:  # enough chunks can still be FP16
                assert int((tiers[row] == FP16).sum()) == 2 + counts[row, FP16]
            for t in (INT4, INT2):
                can = int((kept[row] & (floor[row] <= t)).sum()) - int((tiers[row] < t).sum())
                assert int((tiers[row] == t).sum()) == min(int(counts[row, t]), can)
    assert torch.equal(k == EVICTED, plain_k == EVICTED)  # floors move tiers, not the evicted set

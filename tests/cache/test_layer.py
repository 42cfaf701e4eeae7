"""The HqeKV layer through a patched tiny random Llama: chunks and tiers across prefill,
chunked input and decode, padded and reordered rows, what it refuses to store."""

import pytest
import torch

import hqekv
from hqekv.patching import output_cache
from hqekv.tiers import EVICTED, FP16

from ..helpers import MIXED, assert_left_padding_matches_single_rows, greedy, prompt, tiny_llama


def _watch_reranks(cache):
    """Record (chunk_pos, k_tier, v_tier) before and after every re-rank of every layer."""
    history = []
    for layer in cache.layers:
        original = layer.rerank

        def rerank(rows, layer=layer, original=original, **kwargs):
            before = (layer.table.chunk_pos.clone(), layer.table.k_tier.clone(), layer.table.v_tier.clone())
            original(rows, **kwargs)
            history.append((before, (layer.table.chunk_pos.clone(), layer.table.k_tier.clone(), layer.table.v_tier.clone())))

        layer.rerank = rerank
    return history


def _tier_map(pos, kt, vt):
    return {
        (b, int(p)): (int(k), int(v))
        for b in range(pos.shape[0])
        for p, k, v in zip(pos[b], kt[b], vt[b])
        if p >= 0
    }


def test_decode_reranks_only_move_down_and_lengths(tiny):
    hqekv.patch_model(tiny, ratios=MIXED, value_group=16)
    ids = prompt(100)
    cache = hqekv.new_cache(tiny)
    history = _watch_reranks(cache)
    n_new = 220
    with torch.no_grad():
        out = tiny.generate(ids, cache=cache, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
    n_tokens = ids.shape[1] + n_new - 1  # the last generated token is never fed back
    assert out.shape[1] == ids.shape[1] + n_new
    assert cache.get_seq_length() == n_tokens
    reranks_per_layer = len(history) // len(cache.layers)
    assert reranks_per_layer >= 1 + n_new // 32 - 1  # prefill + one per 32 generated tokens
    moved_down = 0
    for before, after in history:
        old, new = _tier_map(*before), _tier_map(*after)
        assert set(new) <= set(old)  # nothing comes back from eviction, no new chunks at re-rank
        for key, (k, v) in new.items():
            assert k >= old[key][0] and v >= old[key][1]
            moved_down += (k > old[key][0]) + (v > old[key][1])
    assert moved_down > 0
    for layer in cache.layers:
        kept = int((layer.table.chunk_pos >= 0).sum())
        assert int(layer.counters.n_chunks) * 32 + int(layer.tail.length) == n_tokens
        assert int(layer.counters.n_evicted) > 0
        assert kept + int(layer.counters.n_evicted) == int(layer.counters.n_chunks)
        k_phys, _, _, valid = layer.physical_cache()
        assert int(valid.sum()) == kept * 32 + int(layer.tail.length)  # physical = kept tokens
        assert k_phys.shape[2] == kept * 32 + 32
        # every tier and the protected FP16 chunks are present
        assert (layer.table.k_tier == EVICTED).sum() == 0
        assert int((layer.table.k_tier == FP16).sum()) >= 1


def test_batch_left_padding_matches_single_rows():
    model = tiny_llama(seed=1)
    hqekv.patch_model(model, ratios=MIXED, value_group=16)
    assert_left_padding_matches_single_rows(model, 70)


def test_multi_token_calls_on_existing_cache(tiny):
    """Chunked prefill: feeding a prompt in pieces uses the same cache machinery."""
    hqekv.patch_model(tiny, ratios=hqekv.FP16_RATIOS, value_group=16)
    ids = prompt(200)
    with torch.no_grad():
        full = tiny(ids).logits[:, -1]
        out = tiny(ids[:, :90], use_cache=True)
        cache = output_cache(out)
        assert isinstance(cache, hqekv.HqeKVCache) and cache.get_seq_length() == 90
        out = tiny(ids[:, 90:170], cache=cache)
        out = tiny(ids[:, 170:], cache=cache)
    assert cache.get_seq_length() == 200
    assert torch.allclose(out.logits[:, -1], full, atol=1e-4)
    # a compressed cache scores a continuation too
    hqekv.unpatch_model(tiny)
    hqekv.patch_model(tiny, ratios=MIXED, value_group=16)
    with torch.no_grad():
        cache = output_cache(tiny(ids[:, :150], use_cache=True))
        cont = tiny(ids[:, 150:], cache=cache).logits
    assert torch.isfinite(cont).all() and cache.get_seq_length() == 200


def test_beam_search_reorders_rows(tiny):
    ids = prompt(130, seed=9)
    ref = greedy(tiny, ids, 40, num_beams=3)
    hqekv.patch_model(tiny, ratios=hqekv.FP16_RATIOS, value_group=16, fp_dtype="model")
    assert torch.equal(greedy(tiny, ids, 40, num_beams=3), ref)
    hqekv.unpatch_model(tiny)
    hqekv.patch_model(tiny, ratios=MIXED, value_group=16)
    out = greedy(tiny, ids, 40, num_beams=3)  # rows share pool slots after reordering, then re-rank
    assert out.shape == ref.shape


@pytest.mark.parametrize("fp_dtype, stored", [(None, torch.float16), ("bfloat16", torch.bfloat16), ("model", torch.float32)])
def test_full_precision_parts_are_16_bit_whatever_the_model_dtype(tiny, fp_dtype, stored):
    """An fp32 model's FP16 chunks, tail and window queries take 16 bits unless fp_dtype="model"."""
    assert tiny.dtype == torch.float32
    hqekv.patch_model(tiny, ratios=hqekv.FP16_RATIOS, value_group=16, fp_dtype=fp_dtype)
    try:
        ids = prompt(150, seed=4)
        with torch.no_grad():
            cache = output_cache(tiny(ids, use_cache=True))
            for _ in range(40):  # decode steps: tail writes, a flush and a re-rank
                cache = output_cache(tiny(ids[:, :1], cache=cache, use_cache=True))
        for layer in cache.layers:
            assert {layer.pools["k"].fp.dtype, layer.pools["v"].fp.dtype, layer.tail.k.dtype, layer.tail.v.dtype, layer.query_window.q.dtype} == {stored}
        report = cache.memory_report()
        bits = 8 * stored.itemsize
        per_element = 8 * (report.bytes_by_part["k.fp16"] + report.bytes_by_part["v.fp16"]) / report.elements
        tail = 2 * 32 / 190  # the 32-token tail buffer per component, over 190 real tokens
        assert per_element == pytest.approx(bits * (1 - (190 % 32) / 190), rel=1e-6)
        assert 8 * report.bytes_by_part["tail"] / report.elements == pytest.approx(bits * tail / 2, rel=0.01)
    finally:
        hqekv.unpatch_model(tiny)


def test_random_importance_keeps_the_tier_counts(tiny):
    """importance="random" (the control) assigns the same number of chunks per tier, to other chunks."""
    counts, tiers = {}, {}
    for kind in ("attention", "random"):
        hqekv.patch_model(tiny, ratios=MIXED, value_group=16, importance=kind)
        try:
            with torch.no_grad():
                cache = output_cache(tiny(prompt(400, seed=5), use_cache=True))
        finally:
            hqekv.unpatch_model(tiny)
        counts[kind] = [layer.chunk_counts() for layer in cache.layers]
        tiers[kind] = [layer.table.k_tier.clone() for layer in cache.layers]
    assert counts["attention"] == counts["random"]
    assert any(not torch.equal(a, r) for a, r in zip(tiers["attention"], tiers["random"]))


def _corrupt_keys_at(model, call: int, factor: float):
    """Multiply layer 0's keys by ``factor`` on its ``call``-th projection (1 = the prefill)."""
    calls = {"n": 0}

    def hook(module, inputs, out):
        calls["n"] += 1
        return out * factor if calls["n"] == call else out

    return model.model.layers[0].self_attn.k_proj.register_forward_hook(hook)


@pytest.mark.parametrize("call,factor,message", [
    (5, float("nan"), "non-finite"),       # a NaN key in a decode step
    (1, float("nan"), "non-finite"),       # in the prompt
    (1, 1e6, "exceed float16's range"),    # finite in fp32, beyond the float16 parts of the cache
    (5, 1e6, "exceed float16's range|non-finite"),
])  # fmt: skip
def test_nan_and_float16_overflow_raise_at_once(tiny, call, factor, message):
    hqekv.patch_model(tiny, ratios=MIXED, value_group=16)
    _corrupt_keys_at(tiny, call, factor)
    steps = []
    with pytest.raises(ValueError, match=message):
        tiny.generate(prompt(100), max_new_tokens=60, min_new_tokens=60, do_sample=False,
                      logits_processor=[lambda ids, scores: steps.append(1) or scores])  # fmt: skip
    assert len(steps) <= call  # raised before the next token, not ~46 tokens later at a re-rank


def test_large_magnitudes_are_kept_with_wide_dtypes(tiny):
    """The remedy the error names works: bf16/fp32 parts and metadata hold fp32-range values."""
    hqekv.patch_model(tiny, ratios=MIXED, value_group=16, fp_dtype="float32", metadata_dtype="float32")
    _corrupt_keys_at(tiny, 1, 1e6)
    with torch.no_grad():
        out = tiny(prompt(100), use_cache=True)
        cache = output_cache(out)
        for _ in range(40):  # decode through a flush and a re-rank
            out = tiny(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
            assert torch.isfinite(out.logits).all()


def _check_slot_tables(layer):
    """Every kept chunk's slot lies in its tier's pool of its component; each slot serves one chunk."""
    from hqekv.tiers import QUANTIZED_TIERS

    valid = layer.table.chunk_pos >= 0
    for component, tier, slot in (("k", layer.table.k_tier, layer.table.k_slot), ("v", layer.table.v_tier, layer.table.v_slot)):
        fp, pools = layer.pools[component].fp, layer.pools[component].quantized
        sizes = {FP16: fp.shape[0], **{t: pools[t].codes.shape[0] for t in QUANTIZED_TIERS}}
        for t, size in sizes.items():
            assert sorted(slot[valid & (tier == t)].tolist()) == list(range(size)), (component, t)


@pytest.mark.parametrize(
    "ratios, key_ratios",
    [
        # e.g. a per-layer budget above 4 bits, keys with fewer FP16 chunks than values
        (hqekv.TierRatios(fp16=0.4, int4=0.4, evict=0.2), hqekv.TierRatios(fp16=0.2, int4=0.6, evict=0.2)),
        (hqekv.TierRatios(fp16=0.5, int4=0.5), hqekv.TierRatios(fp16=0.3, int4=0.7)),
        (MIXED, None),
    ],
)
def test_full_precision_chunks_hold_their_own_tokens_through_chunked_feeding_and_decode(
    ratios, key_ratios, monkeypatch
):
    """Re-ranks move K and V chunks down apart, so the two FP16 pools differ in size; a chunk
    flushed afterwards must still find its own keys and values (a shared slot read another chunk's)."""
    from hqekv.cache import HqeKVLayer

    fed = {}  # layer index -> the keys and values its attention stored, in order
    attend = HqeKVLayer.attend

    def recording_attend(self, query, key, value, *args, **kwargs):
        fed.setdefault(self.layer_idx, []).append((key.detach().clone(), value.detach().clone()))
        return attend(self, query, key, value, *args, **kwargs)

    monkeypatch.setattr(HqeKVLayer, "attend", recording_attend)
    model = tiny_llama(seed=3)
    hqekv.patch_model(model, ratios=ratios, key_ratios=key_ratios, value_group=16, fp_dtype="model")
    ids = prompt(700, seed=7)
    with torch.no_grad():
        cache = output_cache(model(ids[:, :160], use_cache=True))
        for start in range(160, 640, 32):  # 32 tokens at a time, as the perplexity task feeds them
            model(ids[:, start : start + 32], cache=cache)
        for t in range(640, 700):  # decode steps: tail writes, flushes and re-ranks
            model(ids[:, t : t + 1], cache=cache)
    diverged = False
    for layer in cache.layers:
        _check_slot_tables(layer)
        keys, values = (torch.cat([kv[i] for kv in fed[layer.layer_idx]], dim=2) for i in (0, 1))
        k_phys, v_phys, positions, _ = layer.physical_cache()
        diverged |= layer.pools["k"].fp.shape[0] != layer.pools["v"].fp.shape[0]
        for phys, truth, tier in ((k_phys, keys, layer.table.k_tier), (v_phys, values, layer.table.v_tier)):
            fp16 = (tier[0] == FP16).repeat_interleave(32)
            at = positions[0, : fp16.numel()][fp16]
            assert at.numel() > 0
            assert torch.equal(phys[0, :, : fp16.numel()][:, fp16], truth[0, :, at])
    if ratios.fp16 > 0:
        assert diverged  # the case this test is about did happen


def test_a_cache_continued_in_another_dtype_is_refused():
    """An fp32 request's cache continued after ``model.to(torch.bfloat16)`` ran on silently."""
    model = tiny_llama()
    hqekv.patch_model(model, ratios=hqekv.TierRatios(int4=1.0))
    ids = torch.randint(1, 128, (1, 80), generator=torch.Generator().manual_seed(1))
    cache = hqekv.new_cache(model)
    with torch.no_grad():
        model(ids, cache=cache)
        model.to(torch.bfloat16)
        with pytest.raises(ValueError, match="begun in torch.float32.*now gives torch.bfloat16"):
            model(ids[:, :1], cache=cache)
        assert model(ids[:, :1]).logits.dtype == torch.bfloat16  # a new request runs


def test_a_re_rank_of_a_cache_held_whole_computes_the_same_scores_with_its_kept_logits(tiny, monkeypatch):
    """A re-rank whose cache is held whole keeps the window's logits from its first pass for
    the next ones (:class:`hqekv.cache.rerank.TileReader`): the scores and the allocator's
    choices are those of computing them again, bit for bit."""
    from hqekv.cache import rerank

    ids = prompt(300, seed=3)
    hqekv.patch_model(tiny, 2.0, ratios="auto")
    try:
        with torch.no_grad():
            cache = output_cache(tiny(ids, use_cache=True))
        layers = list(cache.layers)
        assert all(rerank.TileReader(layer).held == {} for layer in layers)  # held: the path under test
        kept = [(rerank.chunk_scores(layer), rerank.allocator_choices(layer)) for layer in layers]
        monkeypatch.setattr(rerank.TileReader, "__init__", _without_kept_logits(rerank.TileReader.__init__))
        assert all(rerank.TileReader(layer).held is None for layer in layers)
        again = [(rerank.chunk_scores(layer), rerank.allocator_choices(layer)) for layer in layers]
    finally:
        hqekv.unpatch_model(tiny)
    for (scores, choices), (scores2, choices2) in zip(kept, again):
        assert all(torch.equal(a, b) for a, b in zip(scores, scores2))
        for name in ("d_k", "d_v", "d_evict", "energy"):
            assert torch.equal(getattr(choices, name), getattr(choices2, name)), name


def _without_kept_logits(init):
    def without(self, layer):
        init(self, layer)
        self.held = None

    return without

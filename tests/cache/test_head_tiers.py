"""Tiers per KV head (``head_tiers=True``): each KV head's part of a chunk is kept, quantized
or evicted apart from the other heads', the layer holding each head as a row of its own."""

from __future__ import annotations

import pytest
import torch

import hqekv
from hqekv.config import TierRatios

from ..helpers import MIXED, assert_left_padding_matches_single_rows, greedy, prompt, stored_bytes, tiny_llama

ONE_TIER = TierRatios(int4=1.0)
"""Every chunk at 4 bits: no choice for a head to make apart from the others."""


def prefill(model, ids, mask=None):
    cache = hqekv.new_cache(model)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, cache=cache)
    return out, cache


def head_tiers_of(layer, row: int) -> list[dict[int, tuple[int, int]]]:
    """Per KV head of batch ``row``: each kept chunk's (key tier, value tier)."""
    table, s = layer.live_table(), layer.split
    return [
        {c: (k, v) for c, k, v in zip(*(x[row * s + h].tolist() for x in (table.chunk_pos, table.k_tier, table.v_tier)))
         if c >= 0}
        for h in range(s)
    ]  # fmt: skip


def head_differences(layer) -> int:
    """(chunk, batch row) pairs whose KV heads hold the chunk at different tiers (evicted: absent)."""
    differ = 0
    for row in range(layer.rows):
        tiers = head_tiers_of(layer, row)
        differ += sum(len({t.get(c) for t in tiers}) > 1 for c in set().union(*tiers))
    return differ


def test_with_one_tier_for_every_chunk_heads_as_rows_change_no_output():
    """The rows only regroup the heads: where every chunk of every head is at the same tier
    (and none is protected in FP16), the logits through a prompt in two pieces, flushes and
    decode re-ranks are the same."""
    model = tiny_llama(layers=2)
    ids = prompt(300, seed=4, batch=2)
    padding = torch.ones_like(ids)
    padding[1, :40] = 0
    logits = {}
    for head_tiers in (False, True):
        hqekv.patch_model(model, ratios=ONE_TIER, protected_chunks=0, head_tiers=head_tiers)
        out, cache = prefill(model, ids[:, :200], padding[:, :200])
        with torch.no_grad():  # a second piece of the prompt: many tokens over the cache
            out = model(input_ids=ids[:, 200:], attention_mask=padding, cache=cache)
        steps = list(out.logits.transpose(0, 1))
        token = out.logits[:, -1:].argmax(-1)
        mask = padding
        with torch.no_grad():
            for _ in range(70):  # two flushes, two decode re-ranks
                cache.maintain()
                mask = torch.cat([mask, torch.ones_like(token)], 1)
                out = model(input_ids=token, attention_mask=mask, cache=cache)
                steps.append(out.logits[:, -1])
                token = out.logits[:, -1:].argmax(-1)
        logits[head_tiers] = torch.stack(steps)
        assert cache.hqekv_layers[0].split == (2 if head_tiers else 1)
        hqekv.unpatch_model(model)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setting", ["auto", "ratios"])
def test_heads_of_a_chunk_take_tiers_of_their_own(setting):
    model = tiny_llama(layers=3)
    if setting == "auto":
        hqekv.patch_model(model, 2.0, ratios="auto", head_tiers=True)
    else:
        hqekv.patch_model(model, ratios=MIXED, head_tiers=True)
    _, cache = prefill(model, prompt(1200, seed=1, batch=2))
    assert sum(head_differences(layer) for layer in cache.hqekv_layers) > 0
    hqekv.unpatch_model(model)
    hqekv.patch_model(model, ratios=MIXED)  # one tier per chunk: the heads never differ
    _, cache = prefill(model, prompt(1200, seed=1, batch=2))
    assert all(layer.split == 1 for layer in cache.hqekv_layers)


@pytest.mark.parametrize("head_tiers", [False, True])
def test_the_memory_report_counts_tokens_and_baselines_as_the_model_holds_them(head_tiers):
    model = tiny_llama(layers=2)
    hqekv.patch_model(model, 2.0, ratios="auto", head_tiers=head_tiers)
    _, cache = prefill(model, prompt(500, seed=2, batch=2))
    report = cache.memory_report()
    assert report.total_bytes == stored_bytes(cache)
    assert report.chunks["real_tokens"] == 2 * 500
    assert report.chunks["tail_tokens"] == 2 * (500 % 32)
    per_token = 2 * model.config.num_key_value_heads * model.config.head_dim  # keys and values, all heads
    assert report.elements == 2 * 500 * per_token * len(cache.hqekv_layers)
    assert report.dense_bytes == report.elements * 4  # fp32
    layer = cache.hqekv_layers[0]
    assert (layer.rows, layer.model_kv_heads) == (2, model.config.num_key_value_heads)
    # a kept chunk counts once per head it is kept for, and its bits as one head's
    counts = report.chunks
    kept = sum(counts[f"{c}.{t}"] for t in ("fp16", "int4", "int2", "int1") for c in ("k",))
    chunks_seen = sum(int(layer.counters.n_chunks.sum()) for layer in cache.hqekv_layers)
    assert kept + counts["evicted"] == chunks_seen


def test_rows_of_heads_are_selected_reordered_and_repeated_by_batch_row():
    """transformers' row operations take batch rows; a row's heads move with it."""
    model = tiny_llama(layers=2)
    hqekv.patch_model(model, 1.0, ratios="auto", head_tiers=True)
    ids = prompt(400, seed=3, batch=3)
    tokens = prompt(40, seed=5, batch=3)

    def decode(cache, rows):
        logits = []
        with torch.no_grad():
            for i in range(tokens.shape[1]):
                cache.maintain()
                out = model(input_ids=tokens[rows, i : i + 1], cache=cache)
                logits.append(out.logits[:, -1])
        return torch.stack(logits)

    rows = torch.tensor([2, 0])
    _, alone = prefill(model, ids[rows])
    expected = decode(alone, rows)
    _, selected = prefill(model, ids)
    selected.batch_select_indices(rows)
    assert selected.hqekv_layers[0].rows == 2 and selected.hqekv_layers[0].batch_size == 4
    torch.testing.assert_close(decode(selected, rows), expected)
    _, reordered = prefill(model, ids)
    reordered.reorder_cache(torch.tensor([2, 0, 0]))
    torch.testing.assert_close(decode(reordered, torch.tensor([2, 0, 0]))[:, :2], expected)
    _, repeated = prefill(model, ids[rows])
    repeated.batch_repeat_interleave(2)
    torch.testing.assert_close(decode(repeated, torch.tensor([2, 2, 0, 0]))[:, ::2], expected)


def test_generate_with_head_tiers_batches_pads_and_searches_beams():
    model = tiny_llama(layers=2)
    hqekv.patch_model(model, 1.0, ratios="auto", head_tiers=True)
    assert_left_padding_matches_single_rows(model, 40)
    ids = prompt(200, seed=6)
    with torch.no_grad():
        beams = model.generate(ids, max_new_tokens=40, num_beams=2, num_return_sequences=2, do_sample=False)
    assert beams.shape == (2, 240)


def test_a_cache_of_heads_as_rows_rejects_states_of_another_shape():
    model = tiny_llama(layers=1)
    hqekv.patch_model(model, 2.0, ratios="auto", head_tiers=True)
    _, cache = prefill(model, prompt(100, seed=7, batch=2))
    layer = cache.hqekv_layers[0]
    q = torch.randn(3, 4, 1, 16)
    kv = torch.randn(3, 2, 1, 16)  # three rows of two heads: as many head rows as two of three
    with pytest.raises(ValueError, match="do not fit a cache of 2 rows, 2 KV heads"):
        layer.attend(q, kv, kv, 0.25)
    with pytest.raises(ValueError, match="head_tiers must be True or False"):
        hqekv.HqeKVConfig(ratios=MIXED, bavg=MIXED.bavg, head_tiers="yes")


@pytest.mark.parametrize("eviction", ["chunk", "head"])
def test_under_the_allocator_heads_are_evicted_together_unless_asked_otherwise(eviction, monkeypatch):
    """``HEAD_EVICTION = "chunk"``: a chunk's heads take their own tiers, but it is evicted
    for all of them or for none, through prefill and decode re-ranks; "head": apart."""
    monkeypatch.setattr(hqekv.allocation, "HEAD_EVICTION", eviction)
    model = tiny_llama(layers=3)
    hqekv.patch_model(model, 0.5, ratios="auto", head_tiers=True)
    out, cache = prefill(model, prompt(1200, seed=1, batch=2))
    token = out.logits[:, -1:].argmax(-1)
    with torch.no_grad():
        for _ in range(70):
            cache.maintain()
            token = model(input_ids=token, cache=cache).logits[:, -1:].argmax(-1)
    apart = 0
    for layer in cache.hqekv_layers:
        assert int(layer.counters.n_evicted.sum()) > 0
        for row in range(layer.rows):
            kept = [set(t) for t in head_tiers_of(layer, row)]
            apart += sum(k != kept[0] for k in kept)
    assert (apart > 0) == (eviction == "head")

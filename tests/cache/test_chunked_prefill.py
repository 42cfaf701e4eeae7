"""Chunked prefill through the compressed cache: ``generate(prefill_chunk_size=C)`` and a
loop of one's own. Padding that spans whole chunks, compile, and the budget across chunks."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import CompileConfig

import hqekv
from hqekv.cache import budget, rerank
from hqekv.eval.tasks import prefill
from hqekv.tiers import FP16, INT4, KEY, VALUE

from ..helpers import MIXED, prompt, sharpen_attention, tiny_llama


def generate(model, ids, mask=None, n=40, **kw):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw
        )[:, ids.shape[1] :]


@pytest.mark.parametrize("setting", [dict(ratios=MIXED), dict(bavg=2.0, ratios="auto")], ids=["ratios", "auto"])
def test_left_padding_that_fills_whole_prompt_chunks_keeps_each_row_its_own_answer(setting):
    """Row 1's first two 64-token prompt chunks are all padding: it is stored from the third
    on, and answers exactly as it does alone with the same chunks (the unpatched model runs
    such a batch; it used to be refused as "all padding")."""
    model = tiny_llama()
    hqekv.patch_model(model, value_group=16, **setting)
    ids = prompt(300, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :128] = 0
    both = generate(model, ids, mask, prefill_chunk_size=64)
    for row, start in ((0, 0), (1, 128)):
        alone = generate(model, ids[row : row + 1, start:], prefill_chunk_size=64)
        assert torch.equal(both[row], alone[0]), row


def test_a_row_of_padding_alone_gets_the_unpatched_answer_at_full_precision():
    """A row that is padding in every prompt chunk decodes from its own tokens, as unpatched."""
    model = tiny_llama()
    ids = prompt(200, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :] = 0
    unpatched = generate(model, ids, mask, n=8, prefill_chunk_size=64)
    hqekv.patch_model(model, ratios=hqekv.config.FP16_RATIOS, fp_dtype="float32", metadata_dtype="float32")
    assert torch.equal(generate(model, ids, mask, n=8, prefill_chunk_size=64), unpatched)


def test_a_compile_config_with_prefill_chunks_runs_them_eagerly_and_compiles_the_decode_step_once():
    """With a compile config ``generate`` sends every prompt chunk through the compiled call;
    storing a chunk is an eager step, so under fullgraph=True that failed ("Skip calling
    torch.compiler.disable()d function") and without it recompiled per chunk."""
    model = tiny_llama()
    hqekv.patch_model(model, ratios=MIXED, value_group=16)
    ids = prompt(300, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :100] = 0
    eager = generate(model, ids, mask, n=70, prefill_chunk_size=64)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    config = CompileConfig(backend=lambda gm, example_inputs: counter(gm, example_inputs), mode=None, fullgraph=True)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told so
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=70, min_new_tokens=70, do_sample=False,
                             prefill_chunk_size=64, compile_config=config, return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences[:, ids.shape[1] :], eager)
    assert counter.frame_count == 1
    assert all(layer.capacity.keeps_addresses() for layer in out.cache.hqekv_layers)  # a compiled request runs over static storage
    assert all(int(layer.counters.n_evicted.sum()) > 0 for layer in out.cache.hqekv_layers)


def test_beam_search_over_prefill_chunks():
    """Beams over a prompt in chunks: exact storage gives the unpatched model's beams, token
    for token; compressed, every beam's prompt is settled before the first step (it evicts
    as many chunks as the same beams over the prompt at once)."""
    model = tiny_llama()
    ids = prompt(300)
    beams = dict(max_new_tokens=12, min_new_tokens=12, num_beams=3, do_sample=False, return_dict_in_generate=True)
    with torch.no_grad():
        unpatched = model.generate(ids, prefill_chunk_size=64, **beams).sequences
        hqekv.patch_model(model, ratios=hqekv.config.FP16_RATIOS, fp_dtype="float32", metadata_dtype="float32")
        assert torch.equal(model.generate(ids, prefill_chunk_size=64, **beams).sequences, unpatched)
        hqekv.unpatch_model(model)
        hqekv.patch_model(model, ratios=MIXED, value_group=16)
        chunked = model.generate(ids, prefill_chunk_size=64, **beams).cache
        once = model.generate(ids, **beams).cache
    evicted = [layer.counters.n_evicted.tolist() for layer in chunked.hqekv_layers]
    assert evicted == [layer.counters.n_evicted.tolist() for layer in once.hqekv_layers]
    assert all(n > 0 for row in evicted for n in row) and len(evicted[0]) == 3
    assert not any(layer.deferring for layer in chunked.hqekv_layers)


@pytest.mark.parametrize("setting", [dict(ratios=MIXED), dict(bavg=2.0, ratios="auto")], ids=["ratios", "auto"])
def test_a_deferred_prompt_keeps_its_waiting_keys_at_8_bits_until_settle(setting):
    """While a prompt arrives in pieces, the keys waiting at the 4-bit tier are stored at 8
    bits (``rerank.WAITING_BITS``), the values at 4: the last piece's logits move less than
    half as far from the unpatched model's as under ``chunked_prefill="wait-4bit"``, where
    every chunk waits at 4 bits (attention sharpened, so that keys matter). ``settle``
    narrows them to the tier's 4 bits."""
    model = tiny_llama(layers=3)
    sharpen_attention(model)
    ids = prompt(1024, seed=5)
    with torch.no_grad():
        unpatched = model(ids).logits[:, -256:]

    def last_piece_error():
        for _, cache in in_pieces(model, ids[:, :-256]):
            pass
        with torch.no_grad():
            logits = model(ids[:, -256:], cache=cache).logits
        return (logits - unpatched).abs().mean().item(), cache

    hqekv.patch_model(model, value_group=16, **setting)
    error, cache = last_piece_error()
    widths = {c: {layer.pools[c].bits(INT4) for layer in cache.hqekv_layers} for c in (KEY, VALUE)}
    assert widths == {KEY: {8}, VALUE: {4}}
    assert all(int((layer.live_table().k_tier == INT4).sum()) > 0 for layer in cache.hqekv_layers)
    report = cache.memory_report()
    held, _ = held_and_allowed(cache)
    assert sum(n for part, n in report.bytes_by_part.items() if part[:2] in ("k.", "v.")) == held
    cache.settle()
    assert {layer.pools[c].bits(INT4) for layer in cache.hqekv_layers for c in (KEY, VALUE)} == {4}
    hqekv.unpatch_model(model)
    hqekv.patch_model(model, value_group=16, chunked_prefill="wait-4bit", **setting)
    narrow, cache = last_piece_error()
    assert {layer.pools[c].bits(INT4) for layer in cache.hqekv_layers for c in (KEY, VALUE)} == {4}
    assert all(int((layer.live_table().k_tier == INT4).sum()) > 0 for layer in cache.hqekv_layers)
    assert all(int(layer.counters.n_evicted.sum()) == 0 for layer in cache.hqekv_layers)
    assert error < 0.5 * narrow, (error, narrow)


def test_chunks_too_short_to_tell_8_bit_codes_from_4_bit_ones_wait_at_4_bits(monkeypatch):
    """Groups of 4 codes or fewer take one word at 4 bits and at 8 (``kernels.holds_wide``):
    with chunks of 4 tokens the waiting keys stay at 4 bits, and a chunked prompt's logits
    are those of ``chunked_prefill="wait-4bit"``, bit for bit, not codes read at the wrong
    width."""
    assert not hqekv.kernels.holds_wide(4) and hqekv.kernels.holds_wide(8) and hqekv.kernels.holds_wide(32)
    monkeypatch.setattr(rerank, "WAITING_RECENT", 16)  # the earlier chunks wait at the 4-bit tier
    model = tiny_llama(layers=2)
    ids = prompt(256, seed=3)
    logits = {}
    for mode in ("wait", "wait-4bit"):
        hqekv.patch_model(model, ratios=MIXED, value_group=16, chunk_size=4, rerank_interval=32, chunked_prefill=mode)
        for _, cache in in_pieces(model, ids[:, :-64], piece=64):
            pass
        assert {layer.pools[KEY].bits(INT4) for layer in cache.hqekv_layers} == {4}
        assert any(int((layer.live_table().k_tier == INT4).sum()) > 0 for layer in cache.hqekv_layers)
        with torch.no_grad():
            logits[mode] = model(ids[:, -64:], cache=cache).logits
        hqekv.unpatch_model(model)
    assert torch.equal(logits["wait"], logits["wait-4bit"])


def in_pieces(model, ids, piece=256, cache=None):
    """A cache that defers eviction (a new one unless ``cache`` is given), fed ``ids`` a piece
    at a time as a loop of one's own does: yields (start of the piece, the cache) after each
    piece's forward."""
    cache = hqekv.new_cache(model) if cache is None else cache
    cache.defer_eviction()
    for start in range(0, ids.shape[1], piece):
        with torch.no_grad():
            model(ids[:, start : start + piece], cache=cache)
        yield start, cache


def stored(model, ids, chunk):
    cache = hqekv.new_cache(model)
    with torch.no_grad():
        prefill(model, ids, cache, chunk)
    return cache.memory_report()


@pytest.mark.parametrize(
    "setting",
    [dict(ratios=MIXED), dict(bavg=2.0, ratios="auto"), dict(bavg=1.0, ratios="auto"),
     dict(bavg=1.5, ratios="auto", layer_bits=[1.0, 1.5, 2.0])],
    ids=["ratios", "auto-2", "auto-1", "auto-layer-bits"],
)  # fmt: skip
def test_the_budget_holds_across_prefill_chunks(setting):
    """The bytes after N prompt chunks are at most those of the same tokens compressed at once
    (1% for rounding of tier counts and downgrades in another order), not one budget per chunk."""
    model = tiny_llama(layers=3)
    hqekv.patch_model(model, value_group=16, **setting)
    ids = prompt(2048, seed=5)
    once = stored(model, ids, None)
    for chunk in (128, 512):
        chunked = stored(model, ids, chunk)
        assert chunked.chunks["real_tokens"] == once.chunks["real_tokens"]
        assert chunked.total_bytes <= 1.01 * once.total_bytes, (chunk, chunked.total_bytes, once.total_bytes)


def held_and_allowed(cache) -> tuple[float, float]:
    """Bytes the chunks of all layers hold, and the model's budget for them."""
    held = sum(float(budget.held_bytes(layer).sum()) for layer in cache.hqekv_layers)
    return held, sum(float(budget.fair_budget(layer).sum()) for layer in cache.hqekv_layers)


def test_the_allocator_keeps_the_model_budget_after_every_prompt_chunk():
    """Under ``ratios="auto"`` the chunks of all layers hold at most ``bavg`` bits per element
    after every forward, once the protected chunks fit in it: a first chunk too small to meet
    the budget must not leave the layers a larger budget for good."""
    model = tiny_llama(layers=3)
    hqekv.patch_model(model, value_group=16, bavg=1.0, ratios="auto")
    ids = prompt(2048, seed=5)
    cache = hqekv.new_cache(model)
    with torch.no_grad():
        for start in range(0, ids.shape[1], 128):
            model(ids[:, start : start + 128], cache=cache)
            held, allowed = held_and_allowed(cache)
            if start >= 256:  # by then the protected chunks fit in the budget
                assert held <= allowed, (start, held, allowed)


def test_under_the_allocator_a_deferred_prompt_waits_at_4_bits_but_its_protected_and_newest_chunks(monkeypatch):
    """Under ``ratios="auto"`` (``DEFERRED_WAIT = "int4"``), while a prompt arrives in pieces,
    every chunk waits at 4 bits, keys and values, but the top ``protected_chunks`` under
    either importance metric and the newest ``WAITING_RECENT`` tokens, in FP16; nothing is
    evicted and the memory report counts what they hold; ``settle()`` brings them within
    the budget."""
    monkeypatch.setattr(rerank, "WAITING_RECENT", 64)  # two chunks of 32
    model = tiny_llama(layers=3)
    hqekv.patch_model(model, value_group=16, bavg=2.0, ratios="auto")
    protected = hqekv.patch_config(model).protected_chunks
    ids = prompt(1024, seed=5)
    for start, cache in in_pieces(model, ids):
        for layer in cache.hqekv_layers:
            table = layer.live_table()
            kept = table.kept()
            newest = rerank.newest_chunks(layer, table, 64)
            assert int(newest.sum()) == 2
            k, v = table.k_tier[kept & ~newest], table.v_tier[kept & ~newest]
            assert torch.equal(k, v) and set(k.tolist()) <= {FP16, INT4}, start
            assert int((k == FP16).sum()) <= 2 * protected  # the top chunks of keys, of values
            assert bool((table.k_tier[newest] == FP16).all() and (table.v_tier[newest] == FP16).all())
        used, _ = held_and_allowed(cache)
        parts = cache.memory_report().bytes_by_part
        assert sum(n for part, n in parts.items() if part[:2] in ("k.", "v.")) == used
    assert all(int(layer.counters.n_evicted.sum()) == 0 for layer in cache.hqekv_layers)
    assert any(int((layer.live_table().k_tier == INT4).sum()) > 0 for layer in cache.hqekv_layers)
    cache.settle()
    used, allowed = held_and_allowed(cache)
    assert used <= allowed
    assert any(int(layer.counters.n_evicted.sum()) > 0 for layer in cache.hqekv_layers)


@pytest.mark.parametrize("allowance, prior", [(2.0, 0.0), (1.5, 1.0)])
def test_a_deferred_prompt_holds_its_stated_allowance_under_the_allocator(allowance, prior, monkeypatch):
    """Under ``ratios="auto"`` with ``DEFERRED_WAIT = "budget"``, while a prompt arrives in
    pieces, the chunks of all layers hold at most ``allocation.DEFERRED`` times the model's
    budget after every piece and evict nothing; the memory report counts what they hold;
    ``settle()`` brings them within the budget itself. ``DEFERRED_PRIOR`` prices the pieces'
    chunks alone: a one-shot prefill is the same with it."""
    monkeypatch.setattr(hqekv.allocation, "DEFERRED_WAIT", "budget")
    monkeypatch.setattr(hqekv.allocation, "DEFERRED", allowance)
    monkeypatch.setattr(hqekv.allocation, "DEFERRED_PRIOR", prior)
    model = tiny_llama(layers=3)
    hqekv.patch_model(model, value_group=16, bavg=2.0, ratios="auto")  # 1-bit chunks fit 1.5 × 2 bits
    ids = prompt(1024, seed=5)

    fills = []
    for start, cache in in_pieces(model, ids):
        used, allowed = held_and_allowed(cache)
        assert used <= allowance * allowed, (start, used, allowed)
        parts = cache.memory_report().bytes_by_part
        assert sum(n for part, n in parts.items() if part[:2] in ("k.", "v.")) == used
        fills.append(used / allowed)
    assert all(int(layer.counters.n_evicted.sum()) == 0 for layer in cache.hqekv_layers)
    assert max(fills) > 0.9 * allowance  # the allowance is what bounds it, not the tokens it has
    cache.settle()
    used, allowed = held_and_allowed(cache)
    assert used <= allowed
    once = hqekv.new_cache(model)
    with torch.no_grad():
        model(ids, cache=once)
    monkeypatch.setattr(hqekv.allocation, "DEFERRED_PRIOR", 0.0)
    again = hqekv.new_cache(model)
    with torch.no_grad():
        model(ids, cache=again)
    for a, b in zip(once.hqekv_layers, again.hqekv_layers):
        assert torch.equal(a.table.k_tier, b.table.k_tier) and torch.equal(a.table.v_tier, b.table.v_tier)


def test_the_eval_prefill_feeds_a_prompt_in_chunks_like_generate():
    """``hqekv eval --prefill-chunk C`` reads prompts through :func:`prefill`: on an unpatched
    model the chunks give the one-shot logits; a chunk of no tokens is an error."""
    model = tiny_llama()
    ids = prompt(300)
    with torch.no_grad():
        once = prefill(model, ids)
        chunked = prefill(model, ids, chunk=64)
    assert chunked.logits.shape == once.logits.shape == (1, 1, 128)
    assert chunked.cache.get_seq_length() == 300
    torch.testing.assert_close(chunked.logits, once.logits, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="at least 1"):
        prefill(model, ids, chunk=0)


@pytest.mark.parametrize("setting", [dict(ratios=MIXED), dict(bavg=2.0, ratios="auto")], ids=["ratios", "auto"])
def test_a_prompt_in_pieces_evicts_only_once_it_is_whole(setting):
    """Between defer_eviction() and settle() re-ranks quantize but evict nothing; settle()
    evicts with the prompt's last queries, as many chunks as the one-shot prefill does."""
    model = tiny_llama(layers=3)
    hqekv.patch_model(model, value_group=16, **setting)
    ids = prompt(1536, seed=2)
    once = hqekv.new_cache(model)
    with torch.no_grad():
        model(ids, cache=once)
    *_, (_, cache) = in_pieces(model, ids)
    assert all(int(layer.counters.n_evicted.sum()) == 0 for layer in cache.hqekv_layers)
    assert all(int((layer.table.k_tier == 0).sum()) < int(layer.counters.n_chunks.sum()) for layer in cache.hqekv_layers)
    cache.settle()
    evicted = sum(int(layer.counters.n_evicted.sum()) for layer in cache.hqekv_layers)
    assert evicted == sum(int(layer.counters.n_evicted.sum()) for layer in once.hqekv_layers) > 0
    assert cache.memory_report().total_bytes <= 1.01 * once.memory_report().total_bytes


@pytest.mark.parametrize("setting", [dict(ratios=MIXED), dict(bavg=1.0, ratios="auto")], ids=["ratios", "auto"])
def test_with_chunked_prefill_evict_every_piece_evicts_within_the_budget(setting):
    """``chunked_prefill="evict"``: a deferred prompt evicts at every piece, so the cache
    stays near its budget while the prompt arrives (the smallest peak), where "wait" holds
    the pieces at 4 bits and evicts nothing until ``settle``; the prompt still ends within
    the bytes of the same prompt at once."""
    ids = prompt(2048, seed=5)
    held = {}
    for mode in ("wait", "evict"):
        model = tiny_llama(layers=3)
        hqekv.patch_model(model, value_group=16, chunked_prefill=mode, **setting)
        assert hqekv.patch_config(model).chunked_prefill == mode
        held[mode] = []
        for start, cache in in_pieces(model, ids, piece=128):
            evicted = sum(int(layer.counters.n_evicted.sum()) for layer in cache.hqekv_layers)
            held[mode].append((held_and_allowed(cache), evicted))
        cache.settle()
        if mode == "evict":
            assert cache.memory_report().total_bytes <= 1.01 * stored(model, ids, None).total_bytes
    assert all(evicted == 0 for _, evicted in held["wait"])
    assert held["evict"][-1][1] > 0
    for ((evict_bytes, allowed), _), ((wait_bytes, _), _) in zip(held["evict"][4:], held["wait"][4:]):
        assert evict_bytes < wait_bytes
        if setting.get("ratios") == "auto":  # the allocator: within the model's budget after every piece
            assert evict_bytes <= allowed, (evict_bytes, allowed)


def test_chunked_prefill_takes_wait_wait_4bit_or_evict():
    with pytest.raises(ValueError, match="chunked_prefill must be one of"):
        hqekv.patch_model(tiny_llama(), bavg=2.0, ratios="auto", chunked_prefill="later")


def test_generate_with_prefill_chunks_settles_the_cache_before_decoding(monkeypatch):
    from hqekv.cache import HqeKVCache

    calls = []
    settle = HqeKVCache.settle
    monkeypatch.setattr(
        HqeKVCache, "settle", lambda self: (calls.append(any(x.deferring for x in self.hqekv_layers)), settle(self))[1]
    )
    model = tiny_llama()
    hqekv.patch_model(model, ratios=MIXED, value_group=16)
    with torch.no_grad():
        out = model.generate(prompt(600), max_new_tokens=4, do_sample=False, prefill_chunk_size=128,
                             return_dict_in_generate=True)  # fmt: skip
    assert calls[0] and not any(calls[1:])  # the end of the prompt settled it, before the decode steps
    assert sum(int(layer.counters.n_evicted.sum()) for layer in out.cache.hqekv_layers) > 0
    assert not any(layer.deferring for layer in out.cache.hqekv_layers)


def test_a_decode_step_settles_a_prompt_whose_loop_forgot_to():
    """A loop of one's own that defers eviction and decodes without settle(): the first
    one-token forward settles, so the budget is not exceeded for the rest of the request."""
    model = tiny_llama()
    hqekv.patch_model(model, ratios=MIXED, value_group=16)
    ids = prompt(1024, seed=4)
    *_, (_, cache) = in_pieces(model, ids)
    assert sum(int(layer.counters.n_evicted.sum()) for layer in cache.hqekv_layers) == 0
    with torch.no_grad():
        model(ids[:, -1:], cache=cache)
    assert not any(layer.deferring for layer in cache.hqekv_layers)
    assert sum(int(layer.counters.n_evicted.sum()) for layer in cache.hqekv_layers) > 0


@pytest.mark.parametrize("chunk", [128, 512])
def test_a_prompt_in_pieces_ends_with_the_tiers_of_the_same_prompt_at_once(chunk):
    """Under fixed ratios, chunks wait at 4 bits at most until the prompt is whole, so its
    end places every tier as a one-shot prefill does: the same count of chunks at each tier
    (and so the same bytes), where chunks pushed lower by early re-ranks used to stay there."""
    model = tiny_llama(layers=3)
    hqekv.patch_model(model, value_group=16, ratios=MIXED)
    ids = prompt(2048, seed=7)
    once, chunked = stored(model, ids, None), stored(model, ids, chunk)
    assert chunked.chunks == once.chunks
    assert chunked.total_bytes == once.total_bytes


@pytest.mark.parametrize("setting", [dict(ratios=MIXED), dict(bavg=2.0, ratios="auto")], ids=["ratios", "auto"])
def test_a_prompt_in_pieces_keeps_its_newest_tokens_in_fp16_until_the_next_piece(setting, monkeypatch):
    """The newest ``WAITING_RECENT`` tokens of a prompt arriving in pieces wait in FP16, which
    the next piece's first queries read most, and move down once newer ones arrive: after each
    piece the chunks among the newest 96 tokens are FP16 (keys and values) and of the older
    chunks no more than the protected ones are; ``settle()`` places them all."""
    monkeypatch.setattr(rerank, "WAITING_RECENT", 96)  # three chunks of 32
    model = tiny_llama(layers=3)
    hqekv.patch_model(model, value_group=16, **setting)
    protected = hqekv.patch_config(model).protected_chunks
    for start, cache in in_pieces(model, prompt(1024, seed=11)):
        for layer in cache.hqekv_layers:
            table = layer.live_table()
            newest = rerank.newest_chunks(layer, table, 96)
            older = table.kept() & ~newest
            assert int(newest.sum()) == 3, start
            assert bool((table.k_tier[newest] == FP16).all() and (table.v_tier[newest] == FP16).all()), start
            assert int((table.k_tier[older] == FP16).sum()) <= 2 * protected, start  # the top of keys, of values
    cache.settle()
    if setting["ratios"] is MIXED:  # the same tiers as the prompt at once
        assert cache.memory_report().chunks == stored(model, prompt(1024, seed=11), None).chunks
    else:  # within the model's budget
        held, allowed = held_and_allowed(cache)
        assert held <= allowed


def test_under_the_allocator_a_prompt_s_piece_waits_at_4_bits_before_the_next_layer_runs(monkeypatch):
    """While a prompt arrives in pieces under ``ratios="auto"``, each layer re-ranks its piece
    within the forward: when a layer runs, every layer before it holds no FP16 chunk but the
    ones it protects (the top ``protected_chunks`` of keys and of values), so the pieces of
    all the layers are never held in FP16 at once (they were, when a piece's re-rank waited
    for the end of the forward); its newest ``WAITING_RECENT`` tokens wait in FP16 too."""
    monkeypatch.setattr(rerank, "WAITING_RECENT", 64)  # two chunks of 32 wait in FP16 as well
    model = tiny_llama(layers=3)
    hqekv.patch_model(model, value_group=16, bavg=2.0, ratios="auto")
    protected = hqekv.patch_config(model).protected_chunks
    cache = hqekv.new_cache(model)
    held = []  # (chunks, FP16 chunks) of each layer before the one that runs
    for i, block in enumerate(model.model.layers):
        forward = block.forward

        def run(*a, forward=forward, i=i, **k):
            for layer in cache.hqekv_layers[:i]:
                table = layer.live_table()
                fp16 = table.kept() & ((table.k_tier == FP16) | (table.v_tier == FP16))
                held.append((int(table.kept().sum()), int(fp16.sum())))
            return forward(*a, **k)

        monkeypatch.setattr(block, "forward", run)
    for _ in in_pieces(model, prompt(1024, seed=5), cache=cache):
        pass
    assert max(chunks for chunks, _ in held) > 4 * protected  # pieces of 8 chunks after the first
    assert all(fp16 <= 2 * protected + 2 for _, fp16 in held), held

"""A static cache (``max_length`` set, as ``generate`` makes it when it compiles the decode
step): storage reserved after the prefill, every tensor a decode step uses at one address
across flushes and re-ranks, the reserve counted, and the same logits as a cache without it."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import CompileConfig

import hqekv
from hqekv.cache import room
from hqekv.config import TierRatios

from ..helpers import DEVICE, Calls, decode_loop, stored_bytes, tiny_llama
from ..helpers import EVERY_TIER

STEPS = 100  # three flushes, two re-ranks after a 72-token prefill
# On a CPU the decode kernel reads a row's chunks in table order whatever the table's width:
# bit-equal. The Triton kernel splits the table among programs by its width.
EXACT = dict(atol=0, rtol=0) if DEVICE == "cpu" else dict(atol=1e-4, rtol=1e-4)


def decode_tensors(cache) -> dict[str, torch.Tensor]:
    """Every tensor a decode step of ``cache`` reads or writes, by layer and place in its list."""
    return {f"{i}.{j}": t for i, layer in enumerate(cache.layers) for j, t in enumerate(layer.decode_tensors())}


def test_decode_tensors_are_the_row_state_the_length_and_the_pools():
    model = tiny_llama().to(DEVICE)
    hqekv.patch_model(model, ratios=EVERY_TIER)
    layer = prefilled(model).layers[0]
    t, tail, window, counters = layer.table, layer.tail, layer.query_window, layer.counters
    named = [t.chunk_pos, t.k_tier, t.k_slot, t.v_tier, t.v_slot, tail.k, tail.v, tail.length, window.q, window.pos,
             window.valid, counters.real_len, counters.n_chunks, counters.n_evicted, counters.since_rerank,
             counters.overrun, counters.budget_share, layer.length]  # fmt: skip
    pools = [t for component in ("k", "v") for t in layer.pools[component].tensors()]
    assert [id(t) for t in layer.decode_tensors()] == [id(t) for t in named + pools]


def prefilled(model, max_length=None):
    ids = torch.randint(1, 128, (2, 72), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :32] = 0  # padding in row 1
    cache = hqekv.new_cache(model, max_length)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache)
    return cache


def follow_tokens():
    return torch.randint(1, 128, (2, STEPS), generator=torch.Generator().manual_seed(6)).to(DEVICE)


class Addresses:
    """Records the address of every decode tensor after each maintain() of a cache."""

    def __init__(self, cache):
        self.cache = cache
        self.seen: dict[str, set[int]] = {}
        maintain = cache.maintain

        def recorded():
            maintain()
            for name, t in decode_tensors(cache).items():
                self.seen.setdefault(name, set()).add(t.data_ptr())

        cache.maintain = recorded

    def moved(self) -> list[str]:
        return sorted(name for name, ptrs in self.seen.items() if len(ptrs) > 1)


def test_static_cache_keeps_every_address_and_the_logits(monkeypatch):
    """100 decode steps, three flushes and two re-ranks, over a cache sized for them: no decode
    tensor moves, each is marked static, and logits and bytes in use are a non-static cache's."""
    model = tiny_llama().to(DEVICE)
    hqekv.patch_model(model, ratios=EVERY_TIER)
    exact, static = prefilled(model), prefilled(model, max_length=72 + STEPS)
    assert all(layer.capacity.keeps_addresses() for layer in static.layers) and not any(layer.capacity.keeps_addresses() for layer in exact.layers)
    expected = decode_loop(model, exact, follow_tokens())
    layer = static.layers[0]
    flushes, reranks = Calls(monkeypatch, layer, "_add_fp16_chunks"), Calls(monkeypatch, layer, "rerank")
    addresses = Addresses(static)
    got = decode_loop(model, static, follow_tokens())
    assert (flushes.count, reranks.count) == (3, 2)
    assert addresses.moved() == []  # the room reserved for 172 tokens was enough: nothing grew
    for name, t in decode_tensors(static).items():
        assert getattr(t, "_dynamo_static_input_type", None) == "unguarded", name  # CUDA graphs replay over it
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, **EXACT, msg=lambda m: f"step {step}: {m}")
    report, plain = static.memory_report(), exact.memory_report()
    assert report.chunks == plain.chunks
    assert report.bytes_by_part["reserve"] > 0 and plain.bytes_by_part["reserve"] == 0
    # the same chunks in use; what a static cache holds beyond them is its reserve, all of it counted
    for part, n in plain.bytes_by_part.items():
        if part != "reserve":
            assert report.bytes_by_part[part] == n, part
    assert report.total_bytes == stored_bytes(static)
    assert plain.total_bytes == stored_bytes(exact)


def test_static_room_is_what_the_ratios_imply_and_the_prefill_gives_back_its_fp16_room():
    """A prefill stores all its chunks in FP16 before re-ranking moves them down; a static cache
    then keeps the room its ratios imply for max_length, not the prefill's FP16 slots."""
    model = tiny_llama().to(DEVICE)
    hqekv.patch_model(model, ratios=EVERY_TIER)
    ids = torch.randint(1, 128, (1, 320), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    cache = hqekv.new_cache(model, 330)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    for layer in cache.hqekv_layers:
        slots, width = room.planned_room(layer)
        # 11 chunks: 2 protected, 0.3/0.4/0.2 of the other 9 in 4/2/1 bits, 0.1 evicted
        assert slots["k"] == {0: 2 + 2, 1: 3 + 2, 2: 4 + 2, 3: 1 + 2} and width == 11  # at most every chunk
        for component, pools in layer.pools.items():
            assert {t: pools.capacity(t) for t in slots[component]} == slots[component]
        assert layer.table.chunk_pos.shape[1] == width
    report = cache.memory_report()
    assert 0 < report.bytes_by_part["reserve"] and report.total_bytes == stored_bytes(cache)


def test_static_cache_that_runs_out_of_room_grows_rarely_and_stays_right():
    """A max_length shorter than the request: storage grows by doubling (a few address changes
    in 100 steps, not one per flush), and the logits stay those of a cache without it."""
    model = tiny_llama().to(DEVICE)
    hqekv.patch_model(model, ratios=EVERY_TIER)
    exact, static = prefilled(model), prefilled(model, max_length=72)
    expected = decode_loop(model, exact, follow_tokens())
    addresses = Addresses(static)
    got = decode_loop(model, static, follow_tokens())
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **EXACT)
    assert addresses.moved(), "a cache sized for the prompt alone must grow"
    assert max(len(p) for p in addresses.seen.values()) <= 3
    assert static.memory_report().total_bytes == stored_bytes(static)


def test_fullgraph_compiled_decode_over_a_static_cache_is_one_graph():
    model = tiny_llama().to(DEVICE)
    hqekv.patch_model(model, ratios=EVERY_TIER)
    exact, static = prefilled(model), prefilled(model, max_length=72 + STEPS)
    expected = decode_loop(model, exact, follow_tokens())
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    got = decode_loop(model, static, follow_tokens(), torch.compile(model, fullgraph=True, backend=counter))
    assert counter.frame_count == 1
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ratios", [EVERY_TIER, "auto"])
def test_generate_makes_its_cache_static_when_it_compiles_the_decode_step(ratios):
    model = tiny_llama().to(DEVICE)
    hqekv.patch_model(model, 1.5 if ratios == "auto" else None, ratios=ratios)
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    run = dict(input_ids=ids, attention_mask=mask, max_new_tokens=70, min_new_tokens=70, do_sample=False,
               return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad():  # on CUDA generate compiles by itself unless told not to
        eager = model.generate(**run, disable_compile=True)
    torch._dynamo.reset()
    config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told so
    with torch.no_grad():
        compiled = model.generate(**run, compile_config=config)
    assert torch.equal(compiled.sequences, eager.sequences)
    static_cache, plain_cache = hqekv.patching.output_cache(compiled), hqekv.patching.output_cache(eager)
    assert all(layer.max_length == 40 + 70 - 1 for layer in static_cache.layers)  # the last token is never stored
    assert not any(layer.capacity.keeps_addresses() for layer in plain_cache.layers)
    assert static_cache.memory_report().chunks == plain_cache.memory_report().chunks


def test_beam_search_reorders_a_static_cache_in_place():
    model = tiny_llama().to(DEVICE)
    hqekv.patch_model(model, ratios=EVERY_TIER)
    ids = torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    run = dict(input_ids=ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, num_beams=3)
    with torch.no_grad():
        expected = model.generate(**run)
        got = model.generate(**run, cache=hqekv.new_cache(model, 100))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("bad", [0, -5, 2.5, True])
def test_max_length_must_be_a_positive_count(bad):
    model = tiny_llama()
    hqekv.patch_model(model, ratios=EVERY_TIER)
    with pytest.raises(ValueError, match="max_length"):
        hqekv.new_cache(model, bad)


def test_compiled_generate_over_static_caches_of_any_prompt_compiles_the_step_once():
    """One row, prompts of three lengths: each request's static cache is sized anew (half the
    chunks evicted, so its tables narrow after the prefill), and the compiled decode step
    is not recompiled for it."""
    model = tiny_llama().to(DEVICE)
    hqekv.patch_model(model, ratios=TierRatios(int4=0.2, int2=0.2, int1=0.1, evict=0.5))
    gen = torch.Generator().manual_seed(11)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    config = CompileConfig(backend=lambda gm, example_inputs: counter(gm, example_inputs), mode=None, fullgraph=True)
    config._compile_all_devices = True
    frames = []
    for n in (160, 600, 900):  # the first widens its tables after the prefill, the others narrow them
        ids = torch.randint(1, 128, (1, n), generator=gen).to(DEVICE)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, compile_config=config,
                                 return_dict_in_generate=True)  # fmt: skip
        assert all(layer.capacity.keeps_addresses() for layer in hqekv.patching.output_cache(out).layers)
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames == frames[:1] * 3, frames  # the later requests compile nothing

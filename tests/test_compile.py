"""torch.compile of a patched model: same tokens as eager, no graph break in the decode
attention, and no recompilation per decode step."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import CompileConfig, LogitsProcessorList

import hqekv
from hqekv.config import TierRatios

from .helpers import DEVICE, Calls, CompileCounts, compiled_generate, decode_loop, greedy, tiny_llama
from .helpers import EVERY_TIER

PER_LAYER = (TierRatios(int4=0.6, int2=0.4), TierRatios(int2=0.2, int1=0.4, evict=0.4))  # 3.2 and 0.8 bits


@pytest.mark.parametrize("setting", ["rotated", "per-layer", "auto", "auto-layer-bits", "auto-heads"])
def test_compiled_generate_equals_eager_and_compiles_decode_once(setting):
    model = tiny_llama().to(DEVICE)
    if setting == "rotated":  # the rotated path compiles too
        hqekv.patch_model(model, ratios=EVERY_TIER, rotation="hadamard")
    elif setting == "auto":  # the rate-distortion allocator re-ranks in the eager step
        hqekv.patch_model(model, 1.5, ratios="auto")
    elif setting == "auto-heads":  # each KV head's part of a chunk at its own tier: a head per row
        hqekv.patch_model(model, 1.5, ratios="auto", head_tiers=True)
    elif setting == "auto-layer-bits":  # the allocator, each layer within its own budget
        hqekv.patch_model(model, 1.5, ratios="auto", layer_bits=[1.0, 2.0])
    else:  # each layer re-ranks at its own ratios, in the one decode graph
        hqekv.patch_model(model, ratios=hqekv.uncalibrated_ratios(2.0), layer_ratios=PER_LAYER)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (2, 50), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding in row 1
    inputs = {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE)}
    new_tokens = 100  # three chunk flushes, re-ranks with 1-bit chunks and evictions
    eager = greedy(model, None, new_tokens, **inputs)
    compiled, per_step = compiled_generate(model, inputs, new_tokens, "inductor")
    assert torch.equal(compiled, eager)
    # Prefill and the first decode step compile their graphs; the 98 steps after that,
    # across flushes and re-ranks that resize pools and tables, compile nothing.
    assert per_step[1] > per_step[0] > 0
    assert per_step[-1] == per_step[1], per_step


@pytest.mark.parametrize("head_tiers", [False, True])
def test_generate_with_a_compile_config_decodes_with_the_compiled_step(head_tiers):
    """``generate(..., compile_config=...)`` compiles the decode step of a patched model as one
    whole graph (fullgraph=True; the cache is compileable and its eager step runs between
    steps), keeps the 2-D padding mask, and gives the eager tokens; with tiers per KV head too."""
    model = tiny_llama().to(DEVICE)
    hqekv.patch_model(model, ratios=EVERY_TIER, head_tiers=head_tiers)
    assert hqekv.new_cache(model).is_compileable
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (2, 40), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding in row 0
    inputs = {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE)}
    eager = greedy(model, None, 70, **inputs)  # two chunk flushes and re-ranks
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    # CompileConfig deep-copies its fields: a function (copied as itself) reaches the counter
    config = CompileConfig(backend=lambda gm, example_inputs: counter(gm, example_inputs), mode=None, fullgraph=True)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told so
    counts = CompileCounts(counter)
    with torch.no_grad():
        compiled = model.generate(
            **inputs, max_new_tokens=70, min_new_tokens=70, do_sample=False, compile_config=config,
            logits_processor=LogitsProcessorList([counts]),
        )  # fmt: skip
    assert torch.equal(compiled, eager)
    # the prefill runs eagerly; the decode steps run the compiled call, compiled at the first one only
    assert counts.per_step[0] == 0 and counts.per_step[1] > 0, counts.per_step
    assert counts.per_step[-1] == counts.per_step[1], counts.per_step


def decode_state(model, n_prompt: int = 70):
    """A patched model's cache after an eager prefill, and the next position."""
    cache = hqekv.new_cache(model)
    ids = torch.randint(1, 128, (1, n_prompt), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    return cache, n_prompt


def attention_inputs(model, position: int, seed: int):
    hidden = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    pe = model.model.rotary_emb(hidden, torch.tensor([[position]], device=DEVICE))
    return hidden, pe


def test_the_decode_graph_inputs_answer_inductors_cuda_graph_checks():
    """Inductor (torch 2.11 and 2.12 on CUDA) asks of every graph input whether a stride is 0
    before it records a CUDA graph; a chunk table's unbacked width must be in no stride, or
    that question cannot be answered and compiling fails (seen on an H200)."""
    from torch._dynamo.backends.common import aot_autograd

    checked = []

    def forward_compiler(gm, example_inputs):
        for t in example_inputs:
            if isinstance(t, torch.Tensor):  # as torch._inductor.output_code.complex_memory_overlap
                checked.append([i for i in range(t.ndim) if t.stride(i) == 0 and t.size(i) != 1])
        return gm.forward

    model = tiny_llama().to(DEVICE)
    hqekv.patch_model(model, ratios=EVERY_TIER)
    ids = torch.randint(1, 128, (2, 50), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    torch._dynamo.reset()
    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, backend=aot_autograd(fw_compiler=forward_compiler))
    try:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    finally:
        model.forward = eager_forward
    assert checked  # the decode graph was compiled, its inputs looked at


def test_decode_attention_forward_has_no_graph_break():
    model = tiny_llama().to(DEVICE)
    hqekv.patch_model(model, ratios=EVERY_TIER)
    cache, position = decode_state(model)
    attention = model.model.layers[0].self_attn
    hidden, pe = attention_inputs(model, position, seed=2)
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(attention.forward)(hidden, pe, None, cache=cache)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_decode_attention_compiles_fullgraph_once_over_flushes_and_reranks():
    """The attention forward alone under fullgraph=True, 80 decode steps, against eager."""
    heavy = TierRatios(int4=0.2, int2=0.2, int1=0.3, evict=0.3)
    eager_model, compiled_model = tiny_llama().to(DEVICE), tiny_llama().to(DEVICE)
    for m in (eager_model, compiled_model):
        hqekv.patch_model(m, ratios=heavy)
    (eager_cache, position), (compiled_cache, _) = decode_state(eager_model, 400), decode_state(compiled_model, 400)
    layer = compiled_cache.layers[0]
    evicted_after_prefill = int(layer.counters.n_evicted.sum())
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    attention = compiled_model.model.layers[0].self_attn
    step = torch.compile(attention.forward, backend=counter, fullgraph=True)
    eager_attention = eager_model.model.layers[0].self_attn
    for i in range(80):
        hidden, pe = attention_inputs(eager_model, position + i, seed=10 + i)
        for cache in (eager_cache, compiled_cache):
            cache.maintain()  # the patched model runs this before each forward
        with torch.no_grad():
            expected, _ = eager_attention(hidden, pe, None, cache=eager_cache)
            got, _ = step(hidden, pe, None, cache=compiled_cache)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
        for cache in (eager_cache, compiled_cache):
            cache.layers[0].advance(1)
    assert counter.frame_count == 1  # one graph for all 80 steps
    assert int(layer.counters.n_evicted.sum()) > evicted_after_prefill  # decode re-ranked and evicted, in place


def test_compiled_smollm2_generate_equals_eager(smollm2):
    model, tokenizer = smollm2
    hqekv.patch_model(model, bavg=2.0)
    try:
        text = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 30)
        inputs = tokenizer(text + " Question: what does the fox jump over? Answer:", return_tensors="pt")
        eager = greedy(model, None, 40, **inputs)
        compiled, per_step = compiled_generate(model, inputs, 40, "inductor")
        assert torch.equal(compiled, eager), tokenizer.batch_decode(torch.stack([eager[0], compiled[0]]))
        assert per_step[-1] == per_step[1], per_step
    finally:
        hqekv.unpatch_model(model)


def test_fullgraph_compiled_model_decodes_100_steps_in_one_graph(monkeypatch):
    """``torch.compile(model, fullgraph=True)``: 100 decode steps with three tail flushes and two
    re-ranks (the eager step between steps) run one graph, compiled once, and give eager's logits."""
    model = tiny_llama().to(DEVICE)
    hqekv.patch_model(model, ratios=EVERY_TIER)
    ids = torch.randint(1, 128, (2, 72), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :32] = 0  # row 1: 40 real tokens after padding, so both rows flush at the same steps
    follow = torch.randint(1, 128, (2, 100), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    caches = [hqekv.new_cache(model), hqekv.new_cache(model)]
    for cache in caches:  # prefill eagerly: the prefill is not part of the decode graph
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, cache=cache)
    eager = decode_loop(model, caches[0], follow)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")  # functionalizes the in-place cache writes
    layer = caches[1].layers[0]
    flushes, reranks = Calls(monkeypatch, layer, "_add_fp16_chunks"), Calls(monkeypatch, layer, "rerank")
    compiled = decode_loop(model, caches[1], follow, torch.compile(model, fullgraph=True, backend=counter))
    assert (flushes.count, reranks.count) == (3, 2)
    assert counter.frame_count == 1
    for step, (got, expected) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {step}: {m}")
    assert caches[1].get_seq_length() == caches[0].get_seq_length() == 172


def test_compiled_decode_without_the_eager_step_fails_loudly():
    """A loop that skips ``cache.maintain()`` cannot flush a full tail: the row answers NaN, never a
    plausible token, and the next eager step raises."""
    model = tiny_llama().to(DEVICE)
    hqekv.patch_model(model, ratios=EVERY_TIER)
    cache = hqekv.new_cache(model)
    with torch.no_grad():
        model(input_ids=torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(7)).to(DEVICE),
              cache=cache)  # fmt: skip
    torch._dynamo.reset()
    step = torch.compile(model, fullgraph=True, backend="eager")
    token = torch.ones(1, 1, dtype=torch.long, device=DEVICE)
    logits = []
    with torch.no_grad():
        for _ in range(6):  # the tail holds 28 tokens: the 5th step finds it full
            logits.append(step(input_ids=token, cache=cache).logits[0, -1])
    assert all(torch.isfinite(x).all() for x in logits[:5])
    assert torch.isnan(logits[5]).all()
    with pytest.raises(RuntimeError, match="without HqeKVCache.maintain"):
        cache.maintain()


def test_the_eager_step_looks_at_the_tails_about_once_per_chunk(monkeypatch):
    """Off a CPU the eager step reads the device only when a tail can be full (each decode step
    adds at most one token): rows whose tails fill at different steps flush at the right
    step, with the logits of a cache that looks at every step."""
    model = tiny_llama().to(DEVICE)
    hqekv.patch_model(model, ratios=EVERY_TIER)
    ids = torch.randint(1, 128, (2, 41), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # tails of 9 and 2 tokens: the rows fill at different steps
    follow = torch.randint(1, 128, (2, 100), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    caches = [hqekv.new_cache(model), hqekv.new_cache(model)]
    for cache in caches:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, cache=cache)
    every = decode_loop(model, caches[0], follow)
    layers = caches[1].hqekv_layers
    looks = []
    for layer in layers:
        layer.look_every_step = False
        looks.append(Calls(monkeypatch, layer, "_look"))
    scheduled = decode_loop(model, caches[1], follow)
    for got, expected in zip(scheduled, every):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    # once after the prefill, then each time a row's tail can be full (each row fills 3 times
    # in 100 steps, at different steps): 7 looks, not 100
    assert [calls.count for calls in looks] == [7] * len(layers)
    assert caches[1].memory_report().chunks == caches[0].memory_report().chunks

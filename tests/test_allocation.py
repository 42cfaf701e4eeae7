"""The rate-distortion allocator (hqekv.allocation, ``ratios="auto"``)."""

from __future__ import annotations

import itertools

import pytest
import torch

import hqekv
from hqekv import allocation, importance
from hqekv.cache.pools import KEY, VALUE, encode_chunks
from hqekv.tiers import EVICTED, FP16, INT1, INT2, INT4

from .helpers import chunk_bytes_of, stored_bytes, tiny_llama


@pytest.mark.parametrize("head_dim,value_group", [(64, 64), (16, 16), (96, 32)])
@pytest.mark.parametrize("meta", [torch.float16, torch.float32])
def test_chunk_bytes_are_the_bytes_a_pool_slot_holds(head_dim, value_group, meta):
    heads, g = 3, 32
    chunk = torch.randn(1, heads, g, head_dim)
    bytes_k, bytes_v = allocation.chunk_bytes(heads, g, head_dim, value_group, 2, meta.itemsize)
    assert bytes_k[FP16] == bytes_v[FP16] == chunk.numel() * 2
    for t in (INT4, INT2, INT1):
        for component, expected in ((KEY, bytes_k), (VALUE, bytes_v)):
            pool = encode_chunks(chunk, t, component, value_group, meta)
            assert expected[t] == sum(x.nbytes for x in pool.tensors()), (t, component)


def test_tier_error_is_the_error_of_the_stored_chunk():
    from hqekv.cache.pools import decode_chunks

    chunks = torch.randn(5, 2, 32, 64) * torch.linspace(0.1, 4, 64)
    for t in (INT4, INT2, INT1):
        for component in (KEY, VALUE):
            back = decode_chunks(encode_chunks(chunks, t, component, 64, torch.float16), t, component, 32, 64, 64,
                                 torch.float32)  # fmt: skip
            measured = allocation.tier_error(chunks, t, component == KEY, 64, torch.float16)
            torch.testing.assert_close(measured, (back - chunks).square(), rtol=1e-5, atol=1e-6)


def random_state(seed=0, b=1, hkv=2, g=2, m=4, n=6 * 32, d=16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * g, m, d, generator=gen)
    k = torch.randn(b, hkv, n, d, generator=gen) * 2
    v = torch.randn(b, hkv, n, d, generator=gen)
    pos = torch.arange(n).expand(b, n)
    qpos = torch.arange(n, n + m).expand(b, m)
    ones_q, ones_k = torch.ones(b, m, dtype=torch.bool), torch.ones(b, n, dtype=torch.bool)
    probs, visible = importance.window_probabilities(q, qpos, ones_q, k, pos, ones_k, d**-0.5)
    return q, k, v, probs, visible


def attention_out(q, k, v, scaling):
    b, hkv, n, d = k.shape
    qg = q.reshape(b, hkv, -1, q.shape[2], d)
    p = torch.softmax(torch.einsum("bhgmd,bhnd->bhgmn", qg, k) * scaling, -1)
    return torch.einsum("bhgmn,bhnd->bhgmd", p, v)


def test_eviction_distortion_is_the_exact_change_of_the_window_outputs():
    q, k, v, probs, _ = random_state()
    s = 16**-0.5
    _, _, d_evict, _ = allocation.distortions(probs, q, k, v, 6, 32, s, 16, torch.float32, "output")
    full = attention_out(q, k, v, s)
    for c in range(6):
        keep = torch.ones(k.shape[2], dtype=torch.bool)
        keep[c * 32 : (c + 1) * 32] = False
        gone = attention_out(q, k[:, :, keep], v[:, :, keep], s)
        torch.testing.assert_close(d_evict[0, c], (gone - full).square().sum(), rtol=1e-4, atol=1e-7)


def test_retrieval_eviction_distortion_is_the_attention_weighted_spread_of_the_chunk():
    q, k, v, probs, _ = random_state()
    _, _, d_evict, _ = allocation.distortions(probs, q, k, v, 6, 32, 16**-0.5, 16, torch.float32)
    out = attention_out(q, k, v, 16**-0.5)  # (B, Hkv, g, m, D)
    spread = (v[:, :, None, None] - out[..., None, :]).square().sum(-1)  # (B, Hkv, g, m, N)
    expected = (probs * spread).reshape(*probs.shape[:4], 6, 32).sum((1, 2, 3, 5))
    torch.testing.assert_close(d_evict, expected, rtol=1e-4, atol=1e-7)


def test_value_distortion_of_one_token_chunks_is_the_exact_output_error_per_query():
    # With chunks of one token and one window query, D_V is exactly ‖p·Δv‖² per query head.
    q, k, v, probs, _ = random_state(m=1, n=8)
    s = 16**-0.5
    _, d_v, _, _ = allocation.distortions(probs, q, k, v, 8, 1, s, 16, torch.float32, "output")
    full = attention_out(q, k, v, s)
    for tier in (INT4, INT2, INT1):
        err = allocation.tier_error(v[0].transpose(0, 1)[:, :, None], tier, False, 16, torch.float32)
        for c in range(8):
            v_hat = v.clone()
            v_hat[0, :, c] += err[c, :, 0].sqrt()  # an error of the measured size
            moved = attention_out(q, k, v_hat, s)
            torch.testing.assert_close(d_v[0, c, tier], (moved - full).square().sum(), rtol=1e-4, atol=1e-8)


def test_distortions_grow_as_tiers_go_down_and_fp16_costs_nothing():
    q, k, v, probs, _ = random_state(seed=1)
    d_k, d_v, _, _ = allocation.distortions(probs, q, k, v, 6, 32, 16**-0.5, 16, torch.float16)
    for d in (d_k, d_v):
        assert (d[..., FP16] == 0).all()
        assert (d[..., INT4] < d[..., INT2]).all() and (d[..., INT2] < d[..., INT1]).all()


def brute_force(d_k, d_v, d_e, bytes_k, bytes_v, evictable):
    """Every choice of every chunk: (distortion, bytes) of each assignment, and the assignments."""
    c = d_k.shape[0]
    options = [(tk, tv) for tk in range(4) for tv in range(4)] + [("E", "E")]
    out = []
    for combo in itertools.product(options, repeat=c):
        dist, used = 0.0, 0.0
        ok = True
        for i, (tk, tv) in enumerate(combo):
            if tk == "E":
                ok &= bool(evictable[i])
                dist += float(d_e[i])
            else:
                dist += float(d_k[i, tk] + d_v[i, tv])
                used += float(bytes_k[tk] + bytes_v[tv])
        if ok:
            out.append((dist, used))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_allocation_is_optimal_for_the_bytes_it_uses(seed):
    gen = torch.Generator().manual_seed(seed)
    c = 4
    d_k = torch.rand(1, c, 4, generator=gen, dtype=torch.float64).cumsum(-1)
    d_v = torch.rand(1, c, 4, generator=gen, dtype=torch.float64).cumsum(-1)
    d_k[..., FP16] = d_v[..., FP16] = 0
    d_e = torch.rand(1, c, generator=gen, dtype=torch.float64) * 6
    bytes_k, bytes_v = allocation.chunk_bytes(2, 32, 16, 16, 2, 2)
    evictable = torch.tensor([[False, True, True, True]])
    tiers = torch.zeros(1, c, dtype=torch.long)
    all_assignments = brute_force(d_k[0], d_v[0], d_e[0], bytes_k, bytes_v, evictable[0])
    for budget in (4000.0, 2500.0, 1200.0, 800.0):
        k, v = allocation.allocate(d_k, d_v, d_e, bytes_k, bytes_v, tiers, tiers, evictable, torch.tensor([budget]))
        kept = k[0] != EVICTED
        used = float((bytes_k[k[0][kept]] + bytes_v[v[0][kept]]).sum())
        dist = float(d_k[0][kept].gather(1, k[0][kept, None]).sum() + d_v[0][kept].gather(1, v[0][kept, None]).sum()
                     + d_e[0][~kept].sum())  # fmt: skip
        assert used <= budget
        assert not (k[0] == EVICTED)[0]  # not evictable
        assert torch.equal(k == EVICTED, v == EVICTED)
        best = min(dist_ for dist_, used_ in all_assignments if used_ <= used)
        assert dist <= best + 1e-9, (budget, dist, best)
    # a budget below the cheapest choice of the chunk that cannot be evicted: that choice, the rest evicted.
    # 16 values of 1 or 2 bits fill one int32 word alike, so the values take 2 bits for the same bytes.
    k, v = allocation.allocate(d_k, d_v, d_e, bytes_k, bytes_v, tiers, tiers, evictable, torch.tensor([100.0]))
    assert bytes_v[INT2] == bytes_v[INT1]
    assert k.tolist() == [[INT1, EVICTED, EVICTED, EVICTED]] and v.tolist() == [[INT2, EVICTED, EVICTED, EVICTED]]


def test_allocation_only_moves_tiers_down_and_spends_more_where_the_budget_is_larger():
    gen = torch.Generator().manual_seed(0)
    d_k = torch.rand(2, 10, 4, generator=gen).cumsum(-1)
    d_v = torch.rand(2, 10, 4, generator=gen).cumsum(-1)
    d_k[..., 0] = d_v[..., 0] = 0
    d_e = d_k[..., INT1] + d_v[..., INT1] + torch.rand(2, 10, generator=gen)  # evicting loses more than 1 bit
    bytes_k, bytes_v = allocation.chunk_bytes(2, 32, 16, 16, 2, 2)
    current = torch.tensor([[FP16, INT2, INT1, INT4, FP16, FP16, INT2, FP16, INT4, FP16]] * 2)
    evictable = torch.ones(2, 10, dtype=torch.bool)
    budget = torch.tensor([2500.0, 6000.0])
    k, v = allocation.allocate(d_k, d_v, d_e, bytes_k, bytes_v, current, current, evictable, budget)
    assert (k >= current).all() and (v >= current).all()
    used = torch.where(k == EVICTED, 0.0, bytes_k[k.clamp(max=3)] + bytes_v[v.clamp(max=3)]).sum(1)
    assert (used <= budget).all() and used[1] > used[0]
    # with room for everything, nothing moves
    k, v = allocation.allocate(d_k, d_v, d_e, bytes_k, bytes_v, current, current, evictable, torch.tensor([1e9, 1e9]))
    assert torch.equal(k, current) and torch.equal(v, current)


def test_sharing_moves_bytes_to_the_layer_whose_relative_error_they_lower_most():
    bytes_k, bytes_v = allocation.chunk_bytes(2, 32, 16, 16, 2, 2)
    gen = torch.Generator().manual_seed(3)

    def layer(scale: float) -> allocation.LayerChoices:
        d = torch.rand(1, 8, 4, generator=gen, dtype=torch.float64).cumsum(-1) * scale
        d[..., FP16] = 0
        tiers = torch.zeros(1, 8, dtype=torch.long)
        return allocation.LayerChoices(d, d.clone(), d[..., INT1] * 4, tiers, tiers, torch.ones(1, 8, dtype=torch.bool),
                                       torch.tensor([3000.0], dtype=torch.float64), torch.tensor([scale]))  # fmt: skip

    # the same errors relative to their output energy: an even split
    (k0, v0), (k1, v1) = allocation.share([layer(1.0), layer(1.0)], bytes_k, bytes_v)
    # the second layer's errors 100x larger against the same energy: it gets more of the 6000 bytes
    first, second = layer(1.0), layer(100.0)
    second.energy = first.energy.clone()
    (a_k, a_v), (b_k, b_v) = allocation.share([first, second], bytes_k, bytes_v)

    def held(k, v):
        return float(torch.where(k == EVICTED, 0.0, bytes_k[k.clamp(max=3)] + bytes_v[v.clamp(max=3)]).sum())

    assert held(a_k, a_v) + held(b_k, b_v) <= 6000
    assert held(b_k, b_v) > held(a_k, a_v)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_floor_keeps_every_layer_a_share_of_its_budget_and_the_total_within_the_model_s(rows):
    """Three layers, the first with errors 1000x smaller against the same energy: one price
    of a byte leaves it nothing; with a floor of half its budget it keeps what that budget
    buys, and the others share what is left (the total stays within the budget)."""
    bytes_k, bytes_v = allocation.chunk_bytes(2, 32, 16, 16, 2, 2)
    gen = torch.Generator().manual_seed(4)

    def layer(scale: float) -> allocation.LayerChoices:
        d = torch.rand(rows, 8, 4, generator=gen, dtype=torch.float64).cumsum(-1) * scale
        d[..., FP16] = 0
        tiers = torch.zeros(rows, 8, dtype=torch.long)
        return allocation.LayerChoices(d, d.clone(), d[..., INT1] * 4, tiers, tiers, torch.ones(rows, 8, dtype=torch.bool),
                                       torch.full((rows,), 3000.0, dtype=torch.float64), torch.ones(rows))  # fmt: skip

    layers = [layer(0.001), layer(1.0), layer(1.0)]
    shared = allocation.share(layers, bytes_k, bytes_v, floor=0.0)
    floored = allocation.share(layers, bytes_k, bytes_v, floor=0.5)
    used = [[allocation.tier_bytes(k, v, bytes_k, bytes_v) for k, v in tiers] for tiers in (shared, floored)]
    assert (used[0][0] == 0).all()  # starved without the floor: every chunk evicted
    # with it, the first layer holds what it would alone with half its budget (whole chunks)
    x = layers[0]
    alone = allocation.allocate(x.d_k, x.d_v, x.d_evict, bytes_k, bytes_v, x.k_tier, x.v_tier, x.evictable, 0.5 * x.budget)
    assert torch.equal(floored[0][0], alone[0]) and torch.equal(floored[0][1], alone[1])
    assert (used[1][0] > 0).all() and (used[1][0] <= 0.5 * 3000).all()
    assert all((u >= 0.5 * 3000).all() for u in used[1][1:])  # the others were above it
    assert (sum(used[1]) <= 9000 + 1e-6).all()
    assert (used[1][1] + used[1][2] < used[0][1] + used[0][2]).all()  # the others gave up what it keeps
    default = allocation.share(layers, bytes_k, bytes_v)  # the default floor is 0
    assert all(torch.equal(a, b) for pair, same in zip(shared, default) for a, b in zip(pair, same))


def test_choices_kept_compact_like_the_table():
    d = torch.arange(2 * 4 * 4, dtype=torch.float32).reshape(2, 4, 4)
    tiers = torch.tensor([[0, 1, 4, 2], [4, 4, 0, -1]])
    found = allocation.LayerChoices(d, d, d[..., 0], tiers, tiers, tiers >= 0, torch.ones(2), torch.ones(2))
    kept = (tiers >= 0) & (tiers != EVICTED)
    out = found.kept(kept, tiers, tiers)
    assert out.k_tier.tolist() == [[0, 1, 2], [0, -1, -1]]
    assert torch.equal(out.d_k[0], d[0, [0, 1, 3]]) and torch.equal(out.d_k[1, 0], d[1, 2])
    assert out.evictable.tolist() == [[True, True, True], [True, False, False]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ratio_bits_are_the_real_bits_a_cache_under_those_shares_holds(dtype):
    values = hqekv.TierRatios(fp16=0.1, int4=0.3, int2=0.2, int1=0.2, evict=0.2)
    keys = hqekv.TierRatios(fp16=0.2, int4=0.2, int2=0.2, int1=0.2, evict=0.2)
    model = tiny_llama().to(dtype)
    hqekv.patch_model(model, ratios=values, key_ratios=keys, protected_chunks=0)
    cache = hqekv.new_cache(model)
    with torch.no_grad():
        model(input_ids=torch.randint(1, 128, (1, 20 * 32), generator=torch.Generator().manual_seed(0)), cache=cache)
    bits = allocation.ratio_bits(hqekv.patch_config(model), model.config.head_dim, dtype)
    hqekv.unpatch_model(model)
    for layer in cache.hqekv_layers:  # 20 chunks: every share is a whole number of them
        assert layer.counters.n_chunks.tolist() == [20] and layer.counters.n_evicted.tolist() == [4]
        elements = 20 * 2 * layer.num_kv_heads * 32 * layer.head_dim
        assert chunk_bytes_of(layer).item() * 8 / elements == pytest.approx(bits, rel=1e-12)
    assert bits > (values.bavg + keys.bavg) / 2  # the code bits, without the metadata


@pytest.mark.parametrize(
    "bavg, prior, floor, next_chunk, head_tiers",
    [(0.5, 0, 0, 0, False), (1.0, 0, 0, 0, False), (2.0, 0, 0, 0, False), (3.2, 0, 0, 0, False), (6.0, 0, 0, 0, False),
     (1.0, 0.3, 0, 0, False), (1.0, 0, 0.5, 0, False), (1.0, 0, 0, 1, False), (0.5, 0, 0, 0, True),
     (2.0, 0, 0, 0, True), (6.0, 0, 0, 0, True)],
)  # fmt: skip
def test_the_budget_holds_at_every_rerank_through_prefill_and_decode(bavg, prior, floor, next_chunk, head_tiers,
                                                                     monkeypatch):  # fmt: skip
    monkeypatch.setattr(hqekv.allocation, "PRIOR", prior)
    monkeypatch.setattr(hqekv.allocation, "LAYER_FLOOR", floor)
    monkeypatch.setattr(hqekv.allocation, "NEXT_CHUNK", next_chunk)
    model = tiny_llama(layers=3)
    hqekv.patch_model(model, bavg, ratios="auto", head_tiers=head_tiers)
    ids = torch.randint(1, 128, (2, 1200), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :150] = 0  # left padding over whole chunks
    cache = hqekv.new_cache(model)
    reranks = 0

    def per_row(layer, x: torch.Tensor) -> torch.Tensor:
        """A layer's per-storage-row amounts summed per batch row (its heads' rows: head_tiers)."""
        return x.reshape(2, -1).sum(1)

    def check(rows: torch.Tensor) -> None:
        # each layer within its share of the budget (a row's heads together), the shares within the model's budget
        total = torch.zeros(2, dtype=torch.float64)
        for layer in cache.hqekv_layers:
            assert layer.split == (2 if head_tiers else 1)
            elements = layer.counters.n_chunks * (2 * layer.num_kv_heads * 32 * layer.head_dim)
            allowed = per_row(layer, layer.counters.budget_share * bavg / 8 * elements)
            assert (per_row(layer, chunk_bytes_of(layer)) <= allowed + 1e-6)[rows].all()
            assert layer.pending is None
            total += per_row(layer, bavg / 8 * elements)
        used = sum(per_row(layer, chunk_bytes_of(layer)) for layer in cache.hqekv_layers)
        assert (used <= total + 1e-6)[rows].all()
        # a layer's share of a batch row's budget: its heads' rows hold equal fair parts
        shares = torch.stack([layer.counters.budget_share.reshape(2, -1).mean(1) for layer in cache.hqekv_layers])
        assert (shares.mean(0) <= 1 + 1e-9).all() and (shares <= hqekv.allocation.PROVISIONAL + 1e-9).all()

    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, cache=cache)
        check(torch.ones(2, dtype=torch.bool))  # the prefill re-ranks every row
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(100):
            before = cache.hqekv_layers[0].counters.since_rerank.clone()
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            out = model(input_ids=token, attention_mask=mask, cache=cache)
            token = out.logits[:, -1:].argmax(-1)
            reranked = cache.hqekv_layers[0].counters.since_rerank <= before  # reset to 0, then this step's token
            reranked = reranked.reshape(2, -1).all(1)  # a row's heads re-rank together
            check(reranked)
            reranks += int(reranked.sum())
    assert reranks >= 4  # both rows re-ranked (at least) twice
    report = cache.memory_report()
    assert report.total_bytes == stored_bytes(cache)
    counts = report.chunks
    if bavg <= 1:
        assert counts["evicted"] > 0
    if bavg >= 6:
        assert counts["k.fp16"] + counts["v.fp16"] > 0


def test_the_parts_of_a_group_are_evicted_together_by_their_summed_distortion():
    """``group`` (tiers per KV head): columns 0 and 2 are one chunk's heads, 1 and 3 another's.
    Each part alone would be evicted where its own eviction costs little; a group goes only
    where its parts' eviction distortions together are below what keeping them costs (at the
    price of a byte the budget sets), and not at all where one part may not be evicted."""
    steps = torch.tensor([0.0, 0.1, 0.2, 0.3])
    d_k = d_v = steps.expand(1, 4, 4).clone()
    d_evict = torch.tensor([[0.01, 0.01, 5.0, 0.01]])
    bytes_kv = torch.tensor([4.0, 2.0, 1.0, 0.5])
    tiers = torch.zeros(1, 4, dtype=torch.long)
    evictable = torch.ones(1, 4, dtype=torch.bool)
    budget = torch.tensor([2.0])  # two parts at 1 bit
    group = torch.tensor([0, 1, 0, 1])
    k, v = allocation.allocate(d_k, d_v, d_evict, bytes_kv, bytes_kv, tiers, tiers, evictable, budget)
    assert (k[0] == EVICTED).nonzero().flatten().tolist() == [0, 1, 3]
    k, v = allocation.allocate(d_k, d_v, d_evict, bytes_kv, bytes_kv, tiers, tiers, evictable, budget, group=group)
    assert (k[0] == EVICTED).nonzero().flatten().tolist() == [1, 3]
    assert k[0, [0, 2]].tolist() == [INT1, INT1] and torch.equal(k == EVICTED, v == EVICTED)
    protected = evictable.clone()
    protected[0, 3] = False  # a part of the second chunk may not go: neither does the chunk, so the first one goes
    k, _ = allocation.allocate(d_k, d_v, d_evict, bytes_kv, bytes_kv, tiers, tiers, protected, budget, group=group)
    assert (k[0] == EVICTED).nonzero().flatten().tolist() == [0, 2]


def test_auto_rejects_fixed_shares():
    model = tiny_llama()
    with pytest.raises(ValueError, match="chooses tiers by itself"):
        hqekv.patch_model(model, 2.0, ratios="auto", key_ratios=(0.5, 0.5, 0, 0))
    with pytest.raises(ValueError, match="'auto'"):
        hqekv.patch_model(model, 2.0, ratios="automatic")
    with pytest.raises(ValueError, match="importance must be 'attention'"):
        hqekv.patch_model(model, 2.0, ratios="auto", importance="random")
    assert not hqekv.is_patched(model)


@pytest.mark.parametrize("error_model", ["retrieval", "output"])
def test_distortions_in_tiles_of_chunks_are_those_of_the_whole_cache(error_model):
    """Tiles bound the transient memory; the distortions do not depend on them."""
    q, k, v, probs, _ = random_state(seed=2)
    whole = allocation.distortions(probs, q, k, v, 6, 32, 16**-0.5, 16, torch.float32, error_model, tile=64)
    for tile in (1, 4):
        tiled = allocation.distortions(probs, q, k, v, 6, 32, 16**-0.5, 16, torch.float32, error_model, tile=tile)
        for a, b in zip(tiled, whole):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)


def test_distortions_are_measured_only_where_a_chunk_can_move():
    """Given the chunks' tiers, a chunk's errors are measured at the tiers below its own
    (what they would be without the tiers), 0 at its own tier and above, and not at all
    where there is no chunk; eviction does not depend on the tiers."""
    q, k, v, probs, _ = random_state(seed=3)
    out = allocation.window_outputs(probs, v)
    args = (probs, q, k, v, out, 32, 16**-0.5, 16, torch.float32)
    full_k, full_v, full_evict = allocation.tile_distortions(*args)
    k_tier = torch.tensor([[FP16, INT4, INT2, INT1, -1, EVICTED]])
    v_tier = torch.tensor([[INT1, INT2, FP16, INT4, EVICTED, -1]])
    d_k, d_v, d_evict = allocation.tile_distortions(*args, k_tier=k_tier, v_tier=v_tier)
    for d, full, tier in ((d_k, full_k, k_tier), (d_v, full_v, v_tier)):
        for c in range(6):
            t = int(tier[0, c])
            below = [x for x in range(1, 4) if 0 <= t < x]
            assert torch.equal(d[0, c, below], full[0, c, below])
            assert not d[0, c, [x for x in range(4) if x not in below]].any()
        assert (full[0, :, 1:] > 0).all()  # the errors left out were not 0
    assert torch.equal(d_evict, full_evict)


def test_the_prior_spreads_a_share_of_each_querys_attention_evenly_over_what_it_sees():
    q, k, v, probs, visible = random_state(seed=4)
    visible = visible.clone()
    visible[:, :2, -40:] = False  # two queries see fewer tokens
    probs = probs * visible[:, None, None]
    probs = probs / probs.sum(-1, keepdim=True)
    seen = visible.sum(-1)
    assert allocation.with_prior(probs, visible, seen, prior=0.0) is probs
    mixed = allocation.with_prior(probs, visible, seen, prior=0.25)
    torch.testing.assert_close(mixed.sum(-1), torch.ones_like(mixed.sum(-1)))
    assert (mixed[..., :2, -40:] == 0).all()  # nothing a query cannot see
    even = (0.25 / seen[:, None, None, :, None]) * visible[:, None, None]
    torch.testing.assert_close(mixed - 0.75 * probs, even.expand_as(mixed))
    # tile by tile (each tile's columns, the whole cache's counts) as the cache prices it
    tiles = [allocation.with_prior(probs[..., t : t + 64], visible[..., t : t + 64], seen, 0.25) for t in (0, 64, 128)]
    torch.testing.assert_close(torch.cat(tiles, -1), mixed)


def test_under_the_prior_chunks_the_window_does_not_read_are_quantized_before_they_are_evicted():
    """The window queries read one chunk only. Priced by them alone, every other chunk is
    free to evict, and the allocator evicts them all to spend the budget on that one; with
    a share of a future query's attention spread evenly, losing a chunk costs something
    everywhere, and the same bytes keep the chunks at low bits."""
    q, k, v, _, visible = random_state(seed=5, hkv=1, g=1)
    q[:] = q[:, :, :1]  # the window's queries all look one way, at the first chunk
    k[:, :, 32:] = k[:, :, 32:] * 0.01
    k[:, :, :32] = q[:, :, :1] * 8
    pos = torch.arange(k.shape[2])[None]
    ones_q, ones_k = torch.ones(1, 4, dtype=torch.bool), torch.ones(1, k.shape[2], dtype=torch.bool)
    probs, visible = importance.window_probabilities(q, pos[:, -4:] + k.shape[2], ones_q, k, pos, ones_k, 0.25)
    assert probs[..., 32:].sum() < 1e-3 * probs.sum()
    bytes_k, bytes_v = allocation.chunk_bytes(1, 32, 16, 16, 2, 2)
    tiers = torch.zeros(1, 6, dtype=torch.long)
    budget = 6 * (bytes_k[INT2] + bytes_v[INT2]) * torch.ones(1)
    evicted = {}
    for prior in (0.0, 0.2):
        priced = allocation.with_prior(probs, visible, visible.sum(-1), prior)
        d_k, d_v, d_e, _ = allocation.distortions(priced, q, k, v, 6, 32, 0.25, 16, torch.float16)
        k_tier, v_tier = allocation.allocate(d_k, d_v, d_e, bytes_k, bytes_v, tiers, tiers,
                                             torch.ones(1, 6, dtype=torch.bool), budget)  # fmt: skip
        assert k_tier[0, 0] != EVICTED
        evicted[prior] = int((k_tier == EVICTED).sum())
    assert evicted[0.0] == 5 and evicted[0.2] == 0


def test_a_chunk_right_after_another_costs_at_least_its_share_of_the_predecessor_s_distortion():
    gen = torch.Generator().manual_seed(4)
    d_k = torch.rand(1, 5, 4, generator=gen)
    d_v = torch.rand(1, 5, 4, generator=gen)
    d_e = torch.tensor([[0.1, 5.0, 0.2, 4.0, 0.3]])
    d_k[0, 1] = d_v[0, 1] = 9.0
    pos = torch.tensor([[0, 1, 2, 4, -1]])  # chunk 3 was evicted: chunk 4 follows nothing kept
    assert all(out is d for out, d in zip(allocation.with_successors(d_k, d_v, d_e, pos, 0.0), (d_k, d_v, d_e)))
    k, v, e = allocation.with_successors(d_k, d_v, d_e, pos, 0.5)
    assert e[0].tolist() == pytest.approx([0.1, 5.0, 2.5, 4.0, 0.3])
    torch.testing.assert_close(k[0, 2], torch.maximum(d_k[0, 2], torch.full((4,), 4.5)))
    torch.testing.assert_close(v[0, 2], torch.maximum(d_v[0, 2], torch.full((4,), 4.5)))
    for i in (0, 1, 3, 4):  # the first, one after a cheaper chunk, one after a gap, an empty column
        torch.testing.assert_close(k[0, i], d_k[0, i] if i != 1 else torch.maximum(d_k[0, 1], 0.5 * d_k[0, 0]))
        assert e[0, i] == d_e[0, i]

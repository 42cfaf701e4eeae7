"""The cache layer's parts on their own (hqekv.cache): tier pools, the chunk table,
re-ranking's pure steps, attention over a view, the FP16 tail, the query window and the
storage capacity strategies."""

from __future__ import annotations

import pytest
import torch

from hqekv.cache import rerank
from hqekv.cache.pools import KEY, VALUE, ComponentPools, decode_chunks, encode_chunks
from hqekv.cache.query_window import QueryWindow
from hqekv.cache.rows import ExactCapacity, StaticCapacity
from hqekv.cache.table import ChunkTable
from hqekv.cache.tail import Tail
from hqekv.cache.view import CacheView
from hqekv.config import HqeKVConfig, TierRatios
from hqekv.tiers import EVICTED, FP16, INT1, INT2, INT4, QUANTIZED_TIERS

H, G, D, GROUP = 2, 8, 16, 16


def prefill_chunks(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """(n, H, G, D) keys and values of one row, as an FP16 prefill leaves them."""
    gen = torch.Generator().manual_seed(seed)
    return {c: torch.randn(n, H, G, D, generator=gen) * (1 + torch.arange(D) % 3) for c in (KEY, VALUE)}


def every_tier(chunks: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Each chunk encoded at every tier, as calibration prepares them."""
    return {
        c: {FP16: x, **{t: encode_chunks(x, t, c, GROUP, torch.float16) for t in QUANTIZED_TIERS}}
        for c, x in chunks.items()
    }


def no_tail() -> Tail:
    empty = torch.zeros(1, H, G, D)
    return Tail(empty, empty.clone(), torch.zeros(1, dtype=torch.long))


def dense_view(pools, table, n_chunks):
    """The placed chunks dequantized, in table order, without a tail."""
    return CacheView(pools, table, no_tail(), GROUP).dequantized(n_chunks, torch.float32)


def test_empty_pools_list_in_op_order_and_count_their_bytes():
    pools = ComponentPools.empty(torch.zeros(1, H, 3, D), VALUE, G, GROUP, torch.float16, torch.float16)
    tensors = pools.op_order()
    assert len(tensors) == 1 + 3 * len(QUANTIZED_TIERS) and all(t.shape[0] == 0 for t in tensors)
    assert tensors[0].shape == (0, H, G, D) and tensors[0].dtype == torch.float16
    assert pools.nbytes() == {"fp16": 0, "int4": 0, "int2": 0, "int1": 0}
    pools.store(FP16, 0, torch.zeros(2, H, G, D), ExactCapacity())
    assert pools.nbytes()["fp16"] == 2 * H * G * D * 2 and pools.tensors()[0] is pools.fp
    assert pools.reserve_nbytes() == 0


@pytest.mark.parametrize("static", [False, True])
def test_pools_store_in_place_with_room_and_grow_without(static):
    """``store`` writes slots in place while the tier has room; without room it grows: by
    ``GROWTH`` in a static cache (so growing is rare), to exactly what it needs otherwise.
    Bytes in use and the reserve add up to every byte the pools hold."""
    chunks = prefill_chunks(9, seed=3)[VALUE]
    pools = ComponentPools.empty(torch.zeros(1, H, 3, D), VALUE, G, GROUP, torch.float16, torch.float16)
    capacity = StaticCapacity(100) if static else ExactCapacity()
    pools.resize(INT2, 8)
    address = pools.quantized[INT2].codes.data_ptr()
    encoded = encode_chunks(chunks, INT2, VALUE, GROUP, torch.float16)
    pools.store(INT2, 0, encoded.select(slice(0, 8)), capacity)
    assert pools.used[INT2] == 8 and pools.capacity(INT2) == 8
    assert pools.quantized[INT2].codes.data_ptr() == address  # room: written in place
    pools.store(INT2, 8, encoded.select(slice(8, 9)), capacity)
    assert pools.used[INT2] == 9 and pools.capacity(INT2) == (10 if static else 9)  # 8 · 1.25 = 10
    for x, y in zip(pools.in_use(INT2).tensors(), encoded.tensors()):
        assert torch.equal(x, y)  # the slots in use survived the growth
    slot_bytes = sum(x[0].nbytes for x in encoded.tensors())
    assert pools.nbytes()["int2"] == 9 * slot_bytes
    assert pools.reserve_nbytes() == (pools.capacity(INT2) - 9) * slot_bytes
    assert pools.reserve_nbytes() + sum(pools.nbytes().values()) == sum(t.nbytes for t in pools.tensors())
    with pytest.raises(ValueError, match="in use"):
        pools.resize(INT2, 6)
    with pytest.raises(ValueError, match="no gaps"):
        pools.store(INT2, 10, encoded.select(slice(0, 1)), capacity)


def test_place_puts_each_chunk_at_its_tier_and_drops_evicted_ones():
    chunks = prefill_chunks(6)
    encoded = every_tier(chunks)
    chunk_pos = torch.arange(6)[None]
    k_tier = torch.tensor([[FP16, INT4, EVICTED, INT2, INT1, INT4]])
    v_tier = torch.tensor([[FP16, INT2, EVICTED, INT2, INT4, INT1]])
    table, pools, dropped = rerank.place(chunk_pos, k_tier, v_tier, encoded, torch.float16)
    assert dropped == 1
    assert table.chunk_pos.tolist() == [[0, 1, 3, 4, 5]]
    assert table.k_tier.tolist() == [[FP16, INT4, INT2, INT1, INT4]]
    assert table.k_slot.tolist() == [[0, 0, 0, 0, 1]]  # each tier's pool takes its chunks in table order
    keys, values, positions, valid = dense_view(pools, table, torch.tensor([6]))
    assert valid[0, : 5 * G].all() and not valid[0, 5 * G :].any()
    assert positions[0, : 5 * G].tolist() == [c * G + i for c in (0, 1, 3, 4, 5) for i in range(G)]
    for j, c in enumerate((0, 1, 3, 4, 5)):
        for comp, tier, got in ((KEY, k_tier, keys), (VALUE, v_tier, values)):
            t = int(tier[0, c])
            expected = chunks[comp][c] if t == FP16 else decode_chunks(encoded[comp][t].select(torch.tensor([c])), t,
                                                                      comp, G, D, GROUP, torch.float32)[0]  # fmt: skip
            if t == FP16:  # FP16 slots hold the chunk in the cache's fp dtype
                expected = expected.to(torch.float16).float()
            torch.testing.assert_close(got[0, :, j * G : (j + 1) * G], expected, atol=0, rtol=0)


def test_rebuild_copies_kept_tiers_requantizes_moved_chunks_and_compacts():
    chunks = prefill_chunks(5, seed=1)
    encoded = every_tier(chunks)
    fp16 = torch.zeros(1, 5, dtype=torch.long)
    table, pools, _ = rerank.place(torch.arange(5)[None], fp16, fp16, encoded, torch.float16)
    keys, values, _, _ = dense_view(pools, table, torch.tensor([5]))
    dense = {c: x[:, :, : 5 * G].reshape(1, H, 5, G, D).transpose(1, 2) for c, x in ((KEY, keys), (VALUE, values))}
    new_k = torch.tensor([[FP16, INT4, EVICTED, INT1, FP16]])
    new_v = torch.tensor([[FP16, INT2, EVICTED, INT1, INT4]])
    read = CacheView(pools, table, no_tail(), GROUP).chunk_reader(torch.float32)
    table2, pools2 = rerank.rebuild(table, pools, new_k, new_v, read, GROUP, torch.float16)
    assert table2.chunk_pos.tolist() == [[0, 1, 3, 4]]
    assert table2.k_tier.tolist() == [[FP16, INT4, INT1, FP16]] and table2.v_tier.tolist() == [[FP16, INT2, INT1, INT4]]
    assert pools2[KEY].fp.shape[0] == 2 and pools2[VALUE].fp.shape[0] == 1
    assert torch.equal(pools2[KEY].fp[table2.k_slot[0, 3]], pools[KEY].fp[4])  # kept in FP16: copied, bit for bit
    # a chunk moved down is encoded from its dequantized values, as placing it there directly would
    placed, placed_pools, _ = rerank.place(torch.arange(5)[None], new_k, new_v, every_tier(
        {c: d[0].float() for c, d in dense.items()}), torch.float16)  # fmt: skip
    for comp in (KEY, VALUE):
        for t in QUANTIZED_TIERS:
            for a, b in zip(pools2[comp].quantized[t].tensors(), placed_pools[comp].quantized[t].tensors()):
                assert torch.equal(a, b), (comp, t)
    with pytest.raises(AssertionError, match="moved up"):
        rerank.rebuild(table2, pools2, torch.zeros_like(table2.k_tier), table2.v_tier,
                       CacheView(pools2, table2, no_tail(), GROUP).chunk_reader(torch.float32), GROUP,
                       torch.float16)  # fmt: skip


def test_the_view_read_by_tiles_or_by_entries_is_the_dense_view_bit_for_bit():
    chunks = prefill_chunks(7, seed=3)
    tiers = torch.tensor([[FP16, INT4, INT2, INT1, INT2, INT4, FP16]])
    table, pools, _ = rerank.place(torch.tensor([[0, 1, 2, 4, 5, 6, 8]]), tiers, tiers.flip(1), every_tier(chunks),
                                   torch.float16)  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    tail_k, tail_v = torch.randn(2, 1, H, G, D, generator=gen)
    n_chunks = torch.tensor([9])
    view = CacheView(pools, table, Tail(tail_k, tail_v, torch.tensor([5])), GROUP)
    keys, values, positions, valid = view.dequantized(n_chunks, torch.float32)
    starts, parts = [], []
    for start, *part in view.dequantized_tiles(n_chunks, torch.float32, tile=3):
        starts.append(start)
        parts.append(part)
    assert starts == [0, 3, 6, 7]  # tiles of 3 table columns, then the tail
    for whole, tiled in zip((keys, values, positions, valid), zip(*parts)):
        assert torch.equal(torch.cat(tiled, dim=-1 if whole.dim() == 2 else 2), whole)
    keys_only = [k for _, k, v, *_ in view.dequantized_tiles(n_chunks, torch.float32, values=False, tile=3)]
    assert torch.equal(torch.cat(keys_only, 2), keys)
    read = view.chunk_reader(torch.float32)
    for cols in (torch.tensor([5, 1, 3]), torch.tensor([6, 0])):  # mixed tiers; FP16 only (read from its slots)
        rows = torch.zeros_like(cols)
        for component, dense in ((KEY, keys), (VALUE, values)):
            expected = torch.stack([dense[0, :, c * G : (c + 1) * G] for c in cols.tolist()])
            assert torch.equal(read(component, rows, cols), expected)


def test_propose_protects_the_top_chunks_and_gives_more_bits_to_higher_scores():
    n = 40
    table = ChunkTable(torch.arange(n)[None], *(torch.zeros(1, n, dtype=torch.long) for _ in range(4)))
    scores = torch.rand(1, n, generator=torch.Generator().manual_seed(2))
    ratios = TierRatios(int4=0.5, int2=0.25, evict=0.25)
    config = HqeKVConfig(ratios=ratios, bavg=ratios.bavg, protected_chunks=2)
    k, v = rerank.propose(config, scores, scores, table, torch.tensor([n]), torch.zeros(1, dtype=torch.long), ratios)
    order = scores[0].argsort(descending=True)
    assert k[0, order[:2]].tolist() == [FP16, FP16]  # the protected chunks
    assert torch.equal(k, v)  # one score for both components: one assignment
    assert k[0, order].diff().ge(0).all()  # down the ranking, tiers only get coarser
    assert abs(int((k == EVICTED).sum()) - 0.25 * (n - 2)) <= 1


def test_attention_over_a_placed_view_equals_attention_over_its_dequantized_tokens():
    chunks = prefill_chunks(4, seed=3)
    k_tier = torch.tensor([[FP16, INT4, INT2, INT1]])
    table, pools, _ = rerank.place(torch.arange(4)[None], k_tier, k_tier.flip(1), every_tier(chunks), torch.float32)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, H, 1, D, generator=gen) for _ in range(3))
    tail_k, tail_v = torch.randn(1, H, G, D, generator=gen), torch.randn(1, H, G, D, generator=gen)
    view = CacheView(pools, table, Tail(tail_k, tail_v, torch.tensor([3])), GROUP)
    out = view.attend(q, k, v, torch.ones(1, 1, dtype=torch.bool), D**-0.5)
    keys, values, _, valid = view.dequantized(torch.tensor([4]), torch.float32)
    keys, values = keys[:, :, valid[0]], values[:, :, valid[0]]
    assert keys.shape[2] == 4 * G + 3
    keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
    expected = torch.softmax(q @ keys.transpose(-1, -2) * D**-0.5, -1) @ values
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_tail_append_compacts_past_padding_and_hands_over_full_chunks():
    gen = torch.Generator().manual_seed(5)
    tail_k, tail_v = torch.randn(2, H, G, D, generator=gen), torch.randn(2, H, G, D, generator=gen)
    tail = Tail(tail_k, tail_v, torch.tensor([5, 0]))
    key, value = torch.randn(2, H, 12, D, generator=gen), torch.randn(2, H, 12, D, generator=gen)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :9] = False  # row 1: 9 padding tokens, then 3 real ones
    chunks_k, chunks_v, ok = tail.append(key, value, valid)
    tk, tv, tl = tail.k, tail.v, tail.length
    assert ok.tolist() == [[True, True], [False, False]] and tl.tolist() == [17 - 2 * G, 3]
    row0 = torch.cat([tail_k[0, :, :5], key[0]], dim=1)  # the 5 held tokens, then the 12 new ones
    assert torch.equal(chunks_k[0, 0], row0[:, :G]) and torch.equal(chunks_k[0, 1], row0[:, G : 2 * G])
    assert torch.equal(tk[0, :, : 17 - 2 * G], row0[:, 2 * G :])
    assert torch.equal(chunks_v[0, 1], torch.cat([tail_v[0, :, :5], value[0]], dim=1)[:, G : 2 * G])
    assert torch.equal(tk[1, :, :3], key[1, :, 9:]) and torch.equal(tv[1, :, :3], value[1, :, 9:])


def test_tail_write_one_fills_in_place_and_refuses_a_full_tail():
    tail_k, tail_v = torch.zeros(3, H, G, D), torch.zeros(3, H, G, D)
    tail_len = torch.tensor([2, G, 0])
    key, value = torch.ones(3, H, 1, D), 2 * torch.ones(3, H, 1, D)
    tail = Tail(tail_k, tail_v, tail_len)
    written, overrun = tail.write_one(key, value, torch.tensor([True, True, False]))
    assert tail.k is tail_k and tail.length is tail_len  # in place: the addresses stay
    assert written.tolist() == [True, False, False] and overrun.tolist() == [False, True, False]
    assert tail_len.tolist() == [3, G, 0]
    assert tail_k[0, :, 2].eq(1).all() and tail_v[0, :, 2].eq(2).all()
    assert tail_k[1].eq(0).all() and tail_k[2].eq(0).all()  # a full tail and a padding token: unchanged


def test_window_keeps_the_last_real_queries_with_their_positions():
    m = 4
    window = QueryWindow.empty(torch.zeros(1, 1, 0, 2), 1, m, torch.float32)
    query = torch.arange(6.0).reshape(1, 1, 6, 1).expand(1, 1, 6, 2)
    valid = torch.tensor([[True, False, True, True, True, True]])
    positions = valid.long().cumsum(1) - 1
    window.append(query, positions, valid)
    assert window.q[0, 0, :, 0].tolist() == [2, 3, 4, 5] and window.pos.tolist() == [[1, 2, 3, 4]]
    assert window.valid.all()
    window.push_one(torch.full((1, 1, 1, 2), 9.0), torch.tensor([5]), torch.tensor([True]))
    assert window.q[0, 0, :, 0].tolist() == [3, 4, 5, 9] and window.pos.tolist() == [[2, 3, 4, 5]]
    window.push_one(torch.full((1, 1, 1, 2), 7.0), torch.tensor([6]), torch.tensor([False]))
    assert window.q[0, 0, :, 0].tolist() == [3, 4, 5, 9]  # a padding token leaves the window as it was


def test_a_chunk_table_grows_as_its_capacity_says_and_reorders_rows_in_place():
    table = ChunkTable.empty(2, torch.device("cpu"))
    ok = torch.tensor([[True, True], [True, False]])
    table.append_fp16(ok, torch.tensor([0, 3]), torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7]), ExactCapacity())
    assert table.width == 2  # exactly what the rows need
    assert table.chunk_pos.tolist() == [[0, 1], [3, -1]] and table.v_slot.tolist() == [[5, 6], [7, -1]]
    assert table.k_tier.tolist() == [[FP16, FP16], [FP16, -1]]
    table.widen(3, StaticCapacity(1000))
    assert table.width == 3  # grown by a quarter at least: max(3, ceil(2 · 1.25))
    assert table.live().width == 2 and table.live_nbytes() == 5 * 2 * 2 * 8
    address = table.chunk_pos.data_ptr()
    table.reorder(torch.tensor([1, 0]))
    assert table.chunk_pos.data_ptr() == address and table.chunk_pos.tolist() == [[3, -1, -1], [0, 1, -1]]
    table.mark_dynamic()
    assert table.chunk_pos.stride() == (1, 2) and table.chunk_pos.tolist() == [[3, -1, -1], [0, 1, -1]]
    other = ChunkTable(*(torch.full((2, 1), 9) for _ in range(5)))
    table.assign(other, StaticCapacity(1000))
    assert table.width == 3 and table.v_tier.tolist() == [[9, -1, -1], [9, -1, -1]]


def test_capacities_size_storage_exactly_or_ahead():
    assert ExactCapacity().room(8, 9) == 9 and not ExactCapacity().keeps_addresses()
    assert StaticCapacity(64).room(8, 9) == 10 and StaticCapacity(64).room(8, 30) == 30
    assert StaticCapacity(64).keeps_addresses() and StaticCapacity(64).max_length == 64
    with pytest.raises(ValueError, match="max_length"):
        StaticCapacity(0)

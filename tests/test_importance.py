import torch

from hqekv.importance import (
    chunk_scores,
    token_metrics,
    window_query_attention,
    window_lse,
    window_probabilities,
    window_tiles,
)


def _naive(q, qpos, qvalid, k, kpos, kvalid, scaling):
    b, hq, m, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    out = torch.zeros(b, hkv, n)
    for bi in range(b):
        for h in range(hkv):
            acc = torch.zeros(g, n)
            cnt = torch.zeros(n)
            for qi in range(m):
                if not qvalid[bi, qi]:
                    continue
                vis = kvalid[bi] & (kpos[bi] <= qpos[bi, qi])
                cnt += vis.float()
                for gi in range(g):
                    logits = (k[bi, h] @ q[bi, h * g + gi, qi]) * scaling
                    logits[~vis] = -float("inf")
                    acc[gi] += torch.softmax(logits, -1).nan_to_num(0)
            out[bi, h] = (acc / cnt.clamp(min=1)).mean(0)
    return out


def test_window_attention_matches_naive_loops_gqa_causal_padding():
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, m, n, d = 2, 6, 2, 5, 12, 8
    q = torch.randn(b, hq, m, d, generator=gen)
    k = torch.randn(b, hkv, n, d, generator=gen)
    kpos = torch.arange(n).repeat(b, 1)
    qpos = torch.arange(n - m, n).repeat(b, 1)
    qpos[1] -= 3  # row 1: the window sits earlier, so the newest keys are in its causal future
    kvalid = torch.ones(b, n, dtype=torch.bool)
    kvalid[0, 2] = False
    qvalid = torch.ones(b, m, dtype=torch.bool)
    qvalid[1, 0] = False
    got = window_query_attention(q, qpos, qvalid, k, kpos, kvalid, 0.3)
    assert torch.allclose(got, _naive(q, qpos, qvalid, k, kpos, kvalid, 0.3), atol=1e-6)
    assert got[0, :, 2].abs().max() == 0


def test_window_probabilities_by_tiles_are_those_of_the_whole_cache():
    """Streamed over tiles of keys (one softmax denominator over all of them), the window
    probabilities are the whole cache's, including a query that sees nothing (zeros)."""
    gen = torch.Generator().manual_seed(1)
    b, hq, hkv, m, n, d = 2, 4, 2, 3, 20, 8
    q = torch.randn(b, hq, m, d, generator=gen) * 3
    k = torch.randn(b, hkv, n, d, generator=gen)
    v = torch.randn(b, hkv, n, d, generator=gen)
    kpos = torch.arange(n).repeat(b, 1)
    qpos = torch.tensor([[17, 18, 19], [2, 19, 19]])
    kvalid = torch.ones(b, n, dtype=torch.bool)
    kvalid[1, :3] = False  # row 1's first query sees nothing
    qvalid = torch.ones(b, m, dtype=torch.bool)
    qvalid[0, 1] = False
    whole, visible = window_probabilities(q, qpos, qvalid, k, kpos, kvalid, 0.3)

    def tiles():
        for s0 in range(0, n, 7):
            cut = slice(s0, s0 + 7)
            yield s0, k[:, :, cut], v[:, :, cut], kpos[:, cut], kvalid[:, cut]

    lse = window_lse(q, qpos, qvalid, tiles(), 0.3)
    assert torch.isinf(lse[1, :, :, 0]).all() and torch.isinf(lse[0, :, :, 1]).all()
    got = list(window_tiles(q, qpos, qvalid, tiles(), 0.3, lse))
    assert [s0 for s0, *_ in got] == [0, 7, 14]
    assert all(torch.equal(tv, v[:, :, s0 : s0 + 7]) for s0, _, tv, _, _ in got)
    torch.testing.assert_close(torch.cat([p for *_, p, _ in got], -1), whole, atol=1e-6, rtol=1e-5)
    assert torch.equal(torch.cat([vis for *_, vis in got], -1), visible)
    assert whole[1, :, :, 0].abs().max() == 0 and torch.cat([p for *_, p, _ in got], -1)[1, :, :, 0].abs().max() == 0

    # the logits the first pass keeps give the second pass exactly what it computes itself
    held = {}
    assert torch.equal(window_lse(q, qpos, qvalid, tiles(), 0.3, held), lse)
    assert sorted(held) == [0, 7, 14]
    again = list(window_tiles(q, qpos, qvalid, tiles(), 0.3, lse, held))
    assert all(torch.equal(p, pg) and torch.equal(vis, vg) for (*_, p, vis), (*_, pg, vg) in zip(got, again))


def test_metrics_and_chunk_scores():
    attn = torch.tensor([[[0.5, 0.25, 0.25, 0.0]], [[0.1, 0.2, 0.3, 0.4]]]).reshape(1, 2, 4)
    values = torch.zeros(1, 2, 4, 3)
    values[0, 0, :, 0] = 2.0  # range 2 on head 0
    values[0, 1, 1, 2] = -1.0  # range 1 on head 1, token 1 only
    mk, mv = token_metrics(attn, values)
    assert torch.allclose(mk, torch.tensor([[0.6, 0.45, 0.55, 0.4]]))
    assert torch.allclose(mv, torch.tensor([[1.0, 0.7, 0.5, 0.0]]))
    assert torch.allclose(chunk_scores(mk, 2), torch.tensor([[0.525, 0.475]]))


def test_random_scores_are_a_fixed_hash_of_layer_and_chunk():
    """The control's scores do not change between re-ranks, differ between layers, K and V."""
    from hqekv.importance import random_scores

    pos = torch.arange(40)[None]
    k, v = random_scores(pos, layer=2)
    assert k.shape == v.shape == (1, 40) and ((k >= 0) & (k < 1)).all()
    k_later, _ = random_scores(pos[:, 5:], layer=2)  # after evicting the first 5 chunks
    assert torch.equal(k_later, k[:, 5:])
    assert not torch.equal(k, v) and not torch.equal(random_scores(pos, layer=3)[0], k)
    assert len(set(k.flatten().tolist())) == 40

"""``mixed_attention``: attention of new queries over the whole mixed-tier cache (SPEC §1.4).

Inputs (``B`` rows, ``Hq`` query heads, ``Hkv`` KV heads, ``S`` new tokens, chunk size G):

- query (B, Hq, S, D); key, value (B, Hkv, S, D): the new tokens, after RoPE; new_valid
  (B, S) bool, False for padding. New token i sees new tokens j <= i that are valid.
- scaling: the softmax scale; cache: a :class:`PackedCache` of the layer's storage, whose fields are
  - k_pools / v_pools: the 10 pool tensors of a component, in :data:`POOL_ORDER`:
    FP16 slots (N, Hkv, G, D), then codes/meta0/meta1 of the 4-bit, 2-bit and 1-bit pools
    (layouts of :mod:`~hqekv.kernels.quantize_pack`). Pools may have free slots. The 4-bit
    pools may hold 8-bit codes (a prompt's waiting chunks): their words say so
    (:func:`tier_formats`), and the reference and the Triton kernel read them at that width
    (the fused CPU kernel leaves such a cache to the reference).
  - k_tier, k_slot, v_tier, v_slot (B, C) int64: the chunk table. Entry (b, c) is a kept chunk
    at tier ``k_tier`` (0 FP16, 1 4-bit, 2 2-bit, 3 1-bit) stored in slot ``k_slot`` of that
    tier's pool; entries with tier < 0 are empty. Every kept chunk precedes the new tokens.
  - tail_k, tail_v (B, Hkv, G, D), tail_len (B,) int64: the newest ``tail_len`` tokens in FP16.
    The FP16 slots and the tail may be stored in a 16-bit dtype under an fp32 query; the
    quantized tiers dequantize to the query dtype.
  - value_group: the channels of a value quantization group.

-> (B, S, Hq, D) in the query dtype. A query that sees no token at all gets zeros.

The Triton kernel walks the chunk table, reads each chunk *packed* and dequantizes it in
registers, with an online softmax across tiers (split over the table for parallelism and
merged by log-sum-exp); the reference dequantizes into one buffer and calls SDPA.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from ..tiers import INT4, QUANTIZED_TIERS, TIER_FORMATS, TILE_CHUNKS, WIDE_BITS
from ..packing import packed_words, unpack_codes
from ..quantization import normal_tables
from ._triton import HAVE_TRITON, INTERPRET, next_power_of_2, require_triton
from .dequantize import dequantize_reference, packed_value_tiles

if HAVE_TRITON:
    from ._triton import tl, triton
    from .dequantize import load_key_tile, load_value_tile

POOL_ORDER = ("fp16", "int4.codes", "int4.meta0", "int4.meta1", "int2.codes", "int2.meta0", "int2.meta1",
              "int1.codes", "int1.meta0", "int1.meta1")  # fmt: skip


def quantized_pool(pools: list[torch.Tensor], tier: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, meta0, meta1) of ``tier`` out of a pool list in :data:`POOL_ORDER`."""
    i = 1 + 3 * QUANTIZED_TIERS.index(tier)
    return pools[i], pools[i + 1], pools[i + 2]


def holds_wide(group_len: int) -> bool:
    """Whether groups of ``group_len`` codes at :data:`~hqekv.tiers.WIDE_BITS` take other word
    counts than at 4 bits, so that :func:`tier_formats` can tell them apart (not for 4 codes
    or fewer: one word either way)."""
    return packed_words(group_len, WIDE_BITS) != packed_words(group_len, TIER_FORMATS[INT4][0])


def tier_formats(pools: list[torch.Tensor]) -> dict[int, tuple[int, bool]]:
    """(bits, normalized) of each quantized tier of a component's pools (:data:`POOL_ORDER`):
    the tier's own (:data:`~hqekv.tiers.TIER_FORMATS`), but a 4-bit pool whose code words
    hold :data:`~hqekv.tiers.WIDE_BITS` codes per group is read at that width. Keys' codes
    are (N, H, D, words) with groups of G tokens, values' (N, H, G, D / group, words)."""
    _, _, g, d = pools[0].shape
    formats = dict(TIER_FORMATS)
    codes = quantized_pool(pools, INT4)[0]
    n = g if codes.dim() == 4 else d // codes.shape[3]
    if holds_wide(n) and codes.shape[-1] == packed_words(n, WIDE_BITS):
        formats[INT4] = (WIDE_BITS, TIER_FORMATS[INT4][1])
    return formats


class PackedCache(NamedTuple):
    """A layer's storage as ``mixed_attention`` reads it: the pools of each component, the
    chunk table, the FP16 tail and the value channel group (layouts in the module docstring).
    The op's schema lays these fields out flat (an op takes tensors, lists and scalars);
    every implementation takes them together."""

    k_pools: list[torch.Tensor]
    v_pools: list[torch.Tensor]
    k_tier: torch.Tensor
    k_slot: torch.Tensor
    v_tier: torch.Tensor
    v_slot: torch.Tensor
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    tail_len: torch.Tensor
    value_group: int

    @property
    def chunk_size(self) -> int:
        return self.tail_k.shape[2]

    def tables(self) -> list[torch.Tensor]:
        """k_tier, k_slot, v_tier, v_slot."""
        return [self.k_tier, self.k_slot, self.v_tier, self.v_slot]


def check_args(query, key, value, new_valid, cache: PackedCache) -> None:
    b, hq, s, d = query.shape
    hkv = key.shape[1]
    torch._check(query.dim() == 4 and key.dim() == 4, lambda: "query and key must be (B, H, S, D)")
    torch._check(key.shape == value.shape, lambda: f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    torch._check(key.shape[0] == b and key.shape[2] == s and key.shape[3] == d, lambda: "query and key shapes disagree")
    torch._check(hq % hkv == 0, lambda: f"{hq} query heads are not a multiple of {hkv} KV heads")
    torch._check(tuple(new_valid.shape) == (b, s), lambda: f"new_valid must be ({b}, {s}), got {tuple(new_valid.shape)}")
    n = len(POOL_ORDER)
    torch._check(len(cache.k_pools) == n and len(cache.v_pools) == n, lambda: f"{n} pool tensors each")
    k_tier = cache.k_tier
    for t in cache.tables():
        torch._check(t.shape == k_tier.shape and t.dim() == 2 and t.shape[0] == b, lambda: "chunk tables must be (B, C)")
    tail_k, tail_v = cache.tail_k, cache.tail_v
    torch._check(tail_k.shape == tail_v.shape and tail_k.shape[:2] == (b, hkv), lambda: "tail must be (B, Hkv, G, D)")
    torch._check(tuple(cache.tail_len.shape) == (b,), lambda: "tail_len must be (B,)")


def cached_tokens(kept: torch.Tensor, tail_len: torch.Tensor, g: int) -> torch.Tensor:
    """Which cached tokens exist, in :func:`gather_chunks` order (chunks, then the tail).

    kept (B, C) bool table entries that hold a chunk, tail_len (B,) -> (B, C·G + G) bool.
    """
    ar = torch.arange(g, device=kept.device)
    return torch.cat([kept.repeat_interleave(g, dim=1), ar[None, :] < tail_len[:, None]], dim=1)


def gather_chunks(
    pools: list[torch.Tensor],
    tier: torch.Tensor,
    slot: torch.Tensor,
    per_channel: bool,
    group: int,
    dtype: torch.dtype,
    tail: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize the chunks a table references, and only those, into one buffer:
    (B, C) -> (B, H, C·G, D) ``dtype``. Empty entries are zeros. With ``tail`` (B, H, G, D),
    each row's tail follows its chunks: -> (B, H, (C + 1)·G, D).

    Per tier, the referenced slots are dequantized together and written in table order, so
    the only buffer as large as the cache is the result.
    """
    fp = pools[0]
    b, c = tier.shape
    _, h, g, d = fp.shape
    out = fp.new_zeros(b, h, c + (tail is not None), g, d, dtype=dtype)
    formats = tier_formats(pools)
    for t in range(1 + len(QUANTIZED_TIERS)):
        entries = (tier == t).nonzero(as_tuple=True)
        # a batch of chunks at a time: the unpacking's temporaries stay the size of a batch
        for rows, cols in zip(*(x.split(TILE_CHUNKS) for x in entries)):
            slots = slot[rows, cols]
            if t == 0:
                out[rows, :, cols] = fp[slots].to(dtype)
            else:
                codes, m0, m1 = quantized_pool(pools, t)
                bits, normalized = formats[t]
                out[rows, :, cols] = dequantize_reference(
                    codes[slots], m0[slots], m1[slots], bits, normalized, per_channel, group, g, d, dtype
                )
    if tail is not None:
        out[:, :, c] = tail
    return out.reshape(b, h, out.shape[2] * g, d)


@functools.lru_cache(maxsize=None)
def _normal_line(bits: int) -> tuple[float, float]:
    """(Δ, c₀) with centre[c] = c·Δ + c₀: the centres of normalized codes as a line (float32
    values). Two centres always lie on one; the CPU mixed attention reads 1-bit codes only."""
    if bits != 1:
        raise NotImplementedError("the CPU mixed attention reads normalized codes of 1 bit only")
    _, centres = normal_tables(bits)
    return float(centres[1] - centres[0]), float(centres[0])


def _affine(m0: torch.Tensor, m1: torch.Tensor, bits: int, normalized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) with x = codes·a + b from a group's metadata pair (scale, zero or std, mean).

    Normalized 1-bit is affine too: centre[c]·std + mean = c·(Δ·std) + (c₀·std + mean).
    Plain metadata comes back as stored (the caller widens it once, with the other tiers').
    """
    if normalized:
        delta, c0 = _normal_line(bits)
        m0 = m0.float()
        return m0 * delta, m0 * c0 + m1.float()
    return m0, m1


def mixed_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    new_valid: torch.Tensor,
    cache: PackedCache,
    scaling: float,
    *,
    strategy: str | None = None,
) -> torch.Tensor:
    """Pure-PyTorch mixed attention; the CPU implementation and the kernel's test reference.

    Two strategies compute the same attention (``strategy=None`` picks by the query count):

    - ``"pools"`` (one new token: decode): never builds a dequantized copy of the cache, see
      :func:`_pool_attention`;
    - ``"dense"`` (several new tokens: calibration; prefill off CPU): dequantizes the cache
      into one buffer, a cost the many queries share, then one SDPA call;
    - ``"tiles"`` (several new tokens on CPU: a prompt chunk): the same attention over
      :data:`TILE_CHUNKS` chunks of the table at a time, each dequantized alone and merged by
      log-sum-exp (:func:`_tiled_attention`), so that neither a dequantized copy of the
      cache nor the scores of all queries against it ever exist whole.
    """
    check_args(query, key, value, new_valid, cache)
    if strategy is None:
        strategy = "pools" if query.shape[2] == 1 else ("tiles" if query.device.type == "cpu" else "dense")
    args = (query, key, value, new_valid, cache, scaling)
    if strategy == "pools":
        return _pool_attention(*args)
    if strategy == "dense":
        return _dense_attention(*args)
    if strategy == "tiles":
        return _tiled_attention(*args)
    raise ValueError(f"unknown strategy {strategy!r}; expected 'pools', 'dense' or 'tiles'")


def _block_attention(query, keys, values, visible, scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the queries (B, g, S, D) of one KV head over one block of its keys/values
    (B, 1, n, D) where ``visible`` (B, S or 1, n) -> output (B, g, S, D) in the query dtype
    and its log-sum-exp (B, g, S) float32, -inf for a query that sees nothing in the block."""
    b, group, s, _ = query.shape
    keys, values = keys.expand(b, group, *keys.shape[2:]), values.expand(b, group, *values.shape[2:])
    mask = torch.zeros(visible.shape, dtype=query.dtype, device=query.device).masked_fill(~visible, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, keys, values, 0.0, False, attn_mask=mask[:, None].expand(b, 1, s, visible.shape[-1]), scale=scaling
    )
    sees = visible.any(-1)[:, None].expand(b, group, s)
    return out, lse.masked_fill(~sees, float("-inf"))


def _tiled_attention(
    query, key, value, new_valid, cache: PackedCache, scaling: float, tile: int = TILE_CHUNKS
) -> torch.Tensor:
    """The attention of ``_dense_attention``, block by block, one KV head at a time: ``tile``
    table entries (that head's slice of them, dequantized alone, :func:`gather_chunks`),
    then the tail with the new tokens (causal, padding masked); each block's output is
    merged into the head's running one by log-sum-exp, in place. The scores of a block are
    tiled again inside the flash kernel. Beyond the output, the transient memory is one
    head's float32 accumulator and one head's tile of the cache, whatever the length of
    the cache and the number of heads."""
    b, hq, s, d = query.shape
    hkv, g = key.shape[1], cache.chunk_size
    group = hq // hkv
    dtype = query.dtype
    result = query.new_empty(b, s, hq, d)
    ar = torch.arange(g, device=query.device)
    tail_seen = (ar[None, :] < cache.tail_len[:, None])[:, None].expand(b, s, g)
    causal = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()[None] & new_valid[:, None, :]
    recent = torch.cat([tail_seen, causal], -1)
    for h in range(hkv):
        heads = slice(h * group, (h + 1) * group)
        q = query[:, heads]
        k_head, v_head = ([p[:, h : h + 1] for p in pools] for pools in (cache.k_pools, cache.v_pools))
        out = query.new_zeros(b, group, s, d, dtype=torch.float32)
        total = query.new_full((b, group, s), float("-inf"), dtype=torch.float32)

        def attend(keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> None:
            nonlocal total
            block_out, block_lse = _block_attention(q, keys, values, visible, scaling)
            new_total = torch.logaddexp(total, block_lse)
            finite = torch.isfinite(new_total)
            keep = torch.where(finite, torch.exp(total - new_total), 0.0)
            take = torch.where(finite, torch.exp(block_lse - new_total), 0.0)
            out.mul_(keep[..., None]).add_(block_out.float().mul_(take[..., None]))
            total = new_total

        for c0 in range(0, cache.k_tier.shape[1], tile):
            kt, ks, vt, vs = (t[:, c0 : c0 + tile] for t in cache.tables())
            visible = (kt >= 0).repeat_interleave(g, 1)[:, None]  # (B, 1, n): every query sees the cache
            if bool(visible.any()):
                attend(
                    gather_chunks(k_head, kt, ks, True, cache.value_group, dtype),
                    gather_chunks(v_head, vt, vs, False, cache.value_group, dtype),
                    visible,
                )
        attend(
            torch.cat([cache.tail_k[:, h : h + 1].to(dtype), key[:, h : h + 1]], 2),
            torch.cat([cache.tail_v[:, h : h + 1].to(dtype), value[:, h : h + 1]], 2),
            recent,
        )  # fmt: skip
        result[:, :, heads] = out.transpose(1, 2)
    return result


def _dense_attention(query, key, value, new_valid, cache: PackedCache, scaling: float) -> torch.Tensor:
    """The cache dequantized into one buffer (chunks, tail), the new tokens after it, one SDPA call."""
    b, hq, s, _ = query.shape
    g, group = cache.chunk_size, cache.value_group
    k_all = torch.cat([gather_chunks(cache.k_pools, cache.k_tier, cache.k_slot, True, group, query.dtype, cache.tail_k), key], 2)
    v_all = torch.cat([gather_chunks(cache.v_pools, cache.v_tier, cache.v_slot, False, group, query.dtype, cache.tail_v), value], 2)
    cached = cached_tokens(cache.k_tier >= 0, cache.tail_len, g)
    causal = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()[None] & new_valid[:, None, :]
    mask = torch.cat([cached[:, None].expand(b, s, -1), causal], -1)  # (B, S, N + S)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, k_all, v_all, attn_mask=mask[:, None], scale=scaling, enable_gqa=hq != key.shape[1]
    )
    out = torch.where(mask.any(-1)[:, None, :, None], out, 0)  # a query that sees nothing: zeros, not NaN
    return out.transpose(1, 2)


def _pool_attention(query, key, value, new_valid, cache: PackedCache, scaling: float) -> torch.Tensor:
    """Attention that reads the pools where they lie, never building a dequantized cache.

    1. logits of every key pool slot: all tiers at once as float codes under an affine map
       (q·k = (q⊙a)·codes + q·b; FP16 slots are codes with a = 1, b = 0), then of the recent
       tokens (the tail and the new tokens, one block), in float32;
    2. one softmax over all of them, masked to the slots in each row's table;
    3. the probabilities moved from key-slot order to value-slot order (a chunk's K and V may
       sit in different tiers), and all value pools weighted by them, again as codes.
    Pools are shared by the rows, so each KV head scores them for all its query rows at once:
    R' = B·(Hq / Hkv)·S rows (row, query head in group, new token). One matmul per component
    whatever the tiers, and few small ops, so that decoding costs little on CPU.
    """
    b, hq, s, d = query.shape
    hkv, g = key.shape[1], cache.chunk_size
    gq = hq // hkv
    r = gq * s  # query rows per sequence row and KV head
    rows = b * r
    dev = query.device
    q = query.float().reshape(b, hkv, r, d) * scaling
    qh = q.transpose(0, 1).reshape(hkv, rows, d)  # (H, R', D)

    # 1. logits (B, H, R, Nk·G + G + S): key pool slots in pool order (fp16, 4, 2, 1 bit), then the recent tokens
    k_sizes = _pool_sizes(cache.k_pools)
    nk = sum(k_sizes)
    codes, a, c = _key_slots(cache.k_pools, k_sizes, g, d)  # (Nk, H, D, G), (Nk, H, D) twice
    qa = (qh * a[:, :, None, :]).reshape(nk * hkv, rows, d)
    qc = torch.bmm(qh, c.permute(1, 2, 0)).permute(2, 0, 1).reshape(nk * hkv, rows, 1)  # q·b per slot
    slot_logits = torch.baddbmm(qc, qa, codes.reshape(nk * hkv, d, g))
    slot_logits = slot_logits.reshape(nk, hkv, b, r, g).permute(2, 1, 3, 0, 4).reshape(b, hkv, r, nk * g)
    recent_k = torch.cat([cache.tail_k.float(), key.float()], dim=2)  # (B, H, G + S, D)
    flat = torch.cat([slot_logits, q @ recent_k.transpose(-1, -2)], dim=-1)

    # 2. masks: the slots of each row's table, then its tail and, causal and without padding, the new tokens
    kg = _global_slots(cache.k_tier, cache.k_slot, k_sizes)  # (B, C)
    own = torch.zeros(b, nk + 1, dtype=torch.bool, device=dev).scatter_(1, kg, True)[:, :nk]  # (B, Nk)
    recent_ok = torch.cat(
        [(torch.arange(g, device=dev) < cache.tail_len[:, None])[:, None].expand(b, s, g),
         torch.ones(s, s, dtype=torch.bool, device=dev).tril() & new_valid[:, None, :]], dim=-1,
    )  # (B, S, G + S)  # fmt: skip
    flat[..., : nk * g].view(b, hkv, r, nk, g).masked_fill_(~own[:, None, None, :, None], -torch.inf)
    flat[..., nk * g :].view(b, hkv, gq, s, g + s).masked_fill_(~recent_ok[:, None, None], -torch.inf)
    probs = torch.softmax(flat, dim=-1)
    # a query that sees nothing gets 0; a NaN from a NaN key propagates, as in the unpatched model
    sees = own.any(1)[:, None] | recent_ok.any(-1)  # (B, S)
    probs = torch.where(sees[:, None, None, :, None], probs.view(b, hkv, gq, s, -1), 0.0).view(b, hkv, r, -1)

    # 3. probabilities in value-slot order (H, R', Nv·G), then the weighted values of all pools
    v_sizes = _pool_sizes(cache.v_pools)
    nv = sum(v_sizes)
    vg = _global_slots(cache.v_tier, cache.v_slot, v_sizes)
    to_key = torch.full((b, nv + 1), nk, dtype=torch.long, device=dev).scatter_(1, vg, kg)[:, :nv]  # nk: zeros
    p_slots = torch.nn.functional.pad(probs[..., : nk * g].reshape(b, hkv, r, nk, g), (0, 0, 0, 1))  # + a zero slot
    p_v = p_slots.transpose(0, 1).gather(3, to_key[None, :, None, :, None].expand(hkv, b, r, nv, g))
    recent_v = torch.cat([cache.tail_v.float(), value.float()], dim=2)
    pooled = _weighted_value_slots(p_v.reshape(hkv, rows, nv * g), cache.v_pools, v_sizes, g, d, cache.value_group)
    out = probs[..., nk * g :] @ recent_v + pooled.reshape(hkv, b, r, d).transpose(0, 1)
    return out.reshape(b, hkv, gq, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, hq, d).to(query.dtype)


def _pool_sizes(pools: list[torch.Tensor]) -> list[int]:
    """Slots of each pool of a component, in tier order fp16, 4, 2, 1 bit."""
    return [pools[0].shape[0]] + [quantized_pool(pools, t)[0].shape[0] for t in QUANTIZED_TIERS]


def _global_slots(tier: torch.Tensor, slot: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Table entries (B, C) -> index into all pools of a component laid end to end (tier order);
    an empty entry -> one spare slot after the pools."""
    offsets = torch.tensor([sum(sizes[:i]) for i in range(len(sizes))], device=tier.device)
    return torch.where(tier >= 0, offsets[tier.clamp(min=0)] + slot, sum(sizes))


def _slot_affines(pools: list[torch.Tensor], sizes: list[int], shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) float32 of every slot of a component, pools end to end: x = codes·a + b, with
    a = 1, b = 0 for the FP16 slots. ``shape``: one slot's metadata shape."""
    fp = pools[0]
    a, b = [fp.new_ones(sizes[0], *shape, dtype=torch.float32)], [fp.new_zeros(sizes[0], *shape, dtype=torch.float32)]
    formats = tier_formats(pools)
    for t, n in zip(QUANTIZED_TIERS, sizes[1:]):
        if n:
            _, m0, m1 = quantized_pool(pools, t)
            a_t, b_t = _affine(m0, m1, *formats[t])
            a.append(a_t)
            b.append(b_t)
    return torch.cat(a), torch.cat(b)  # the float32 FP16 parts widen the 16-bit metadata


def _key_slots(pools: list[torch.Tensor], sizes: list[int], g: int, d: int):
    """Every key pool slot as float codes with the affine map x = codes·a + b that dequantizes them.

    -> codes (N, H, D, G) (each chunk transposed), a and b (N, H, D), slots in pool order;
    FP16 slots are their values with a = 1, b = 0. Each tier unpacks straight into its rows.
    """
    h = pools[0].shape[1]
    codes = pools[0].new_empty(sum(sizes), h, d, g, dtype=torch.float32)
    codes[: sizes[0]] = pools[0].transpose(-1, -2)
    start = sizes[0]
    formats = tier_formats(pools)
    for t, n in zip(QUANTIZED_TIERS, sizes[1:]):
        if n:
            unpack_codes(quantized_pool(pools, t)[0], formats[t][0], g, torch.float32, out=codes[start : start + n])
            start += n
    return codes, *_slot_affines(pools, sizes, (h, d))


def _weighted_value_slots(
    p: torch.Tensor, pools: list[torch.Tensor], sizes: list[int], g: int, d: int, group: int
) -> torch.Tensor:
    """Σ over every value pool slot of probability × value, without dequantizing the values.

    p (H, R', N·G) float32 in pool order -> (H, R', D). With v = codes·a + b per group of
    ``group`` channels (FP16 slots: a = 1, b = 0): Σ p·v = Σ (p·a)·codes + Σ p·b, one matmul
    per (head, group) that contracts all N·G tokens at once. Each tier's codes unpack
    head-major, straight into their columns of the matmul operand.
    """
    h, rows = p.shape[:2]
    ng = -(-d // group)
    n0, n_all = sizes[0], sum(sizes)
    codes = p.new_empty(h, ng, n_all, g, group)
    fp = pools[0] if ng * group == d else torch.nn.functional.pad(pools[0], (0, ng * group - d))
    codes[:, :, :n0] = fp.reshape(n0, h, g, ng, group).permute(1, 3, 0, 2, 4)
    start = n0
    formats = tier_formats(pools)
    for t, n in zip(QUANTIZED_TIERS, sizes[1:]):
        if n:
            words = quantized_pool(pools, t)[0]  # (N, H, G, ng, W)
            unpack_codes(words.permute(1, 3, 0, 2, 4), formats[t][0], group, torch.float32,
                         out=codes[:, :, start : start + n])  # fmt: skip
            start += n
    a, b = _slot_affines(pools, sizes, (h, g, ng))  # (N, H, G, ng) each
    pa = p[:, None] * a.permute(1, 3, 0, 2).reshape(h, ng, 1, n_all * g)
    out = torch.bmm(pa.reshape(h * ng, rows, n_all * g), codes.reshape(h * ng, n_all * g, group))
    out = out.reshape(h, ng, rows, group).transpose(1, 2)
    out = out + (p[..., None] * b.transpose(0, 1).reshape(h, 1, n_all * g, ng)).sum(2)[..., None]  # (a bmm is slower)
    return out.reshape(h, rows, ng * group)[..., :d]


if HAVE_TRITON:

    @triton.jit
    def _online_update(q, k, v, token_ok, m_i, l_i, acc, scaling, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
        """One block of keys/values (BLOCK_T, BLOCK_D) into the running softmax state of q (BLOCK_R, BLOCK_D)."""
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)))
        s = tl.where(token_ok, s * scaling, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        if IEEE:
            pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
        else:
            pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE))
        return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv

    @triton.jit
    def _fp16_tile(ptr, strides, slot, head, G, D, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        """One FP16 chunk (slot, head, token, channel; channels contiguous): a slot of the FP16
        pool, or a row's tail -> (BLOCK_G, BLOCK_D) fp32, zeros past G tokens and D channels."""
        j = tl.arange(0, BLOCK_G)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        offset = slot.to(tl.int64) * strides[0] + head * strides[1] + j * strides[2] + d
        return tl.load(ptr + offset, mask=(j < G) & (d < D), other=0.0).to(tl.float32)

    @triton.jit
    def _mixed_attention_kernel(
        new, new_strides, valid_ptr,
        k_pools, k_strides, v_pools, v_strides, centres_ptr,
        table, table_strides, tail, tail_strides, parts,
        HKV, GQ, S, G, D, GROUP, C, CPS, SPLITS, scaling,
        BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
        DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, PACKED_V: tl.constexpr, K4_BITS: tl.constexpr,
        V4_BITS: tl.constexpr,
    ):  # fmt: skip
        """Program per (row b, KV head h, split): rows r = (query head in group, new token) of q.

        Pointers come in tuples, each with the strides (in elements; channels contiguous) of
        its tensors:
        - new = (query, key, value); new_strides = the query's and the key's (row, head, token)
          (the value shares the key's); valid_ptr (B, S) int8;
        - k_pools, v_pools = (FP16 slots, then (codes, meta0, meta1) of the 4-, 2- and 1-bit
          pools); k_strides, v_strides = (the slots' (slot, head, token), then (codes', meta's)
          of each packed pool, as :func:`load_key_tile` / :func:`load_value_tile` read them);
        - table = (k_tier, k_slot, v_tier, v_slot), sharing table_strides (row, chunk);
        - tail = (tail_k, tail_v, tail_len); tail_strides = tail_k's (row, head, token) (tail_v
          shares them) and tail_len's row stride;
        - parts = (o, m, l): the partial outputs (B, Hkv, SPLITS, BLOCK_R, D) and (B, Hkv, SPLITS, BLOCK_R).
        """
        q_ptr, k_ptr, v_ptr = new
        s_q, s_new = new_strides
        kt_ptr, ks_ptr, vt_ptr, vs_ptr = table
        s_tb, s_tc = table_strides
        tk_ptr, tv_ptr, tl_ptr = tail
        s_t, s_tl = tail_strides
        o_ptr, m_ptr, l_ptr = parts
        # 1. program -> (b, h, split); the GQ·S query rows of this KV head
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // HKV
        h = pid % HKV
        r = tl.arange(0, BLOCK_R)
        qi = r % S  # new-token index of each row
        qh = h * GQ + r // S  # query head of each row
        row_ok = r < GQ * S
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        q = tl.load(q_ptr + b.to(tl.int64) * s_q[0] + qh[:, None] * s_q[1] + qi[:, None] * s_q[2] + d[None, :],
                    mask=row_ok[:, None] & dm[None, :], other=0.0).to(DOT_DTYPE)  # fmt: skip
        m_i = tl.full((BLOCK_R,), -float("inf"), tl.float32)
        l_i = tl.zeros((BLOCK_R,), tl.float32)
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        j = tl.arange(0, BLOCK_G)
        in_chunk = (j < G)[None, :]

        # 2. this split's chunks, each read at its own tier (0 FP16, 1 4-bit, 2 2-bit, 3 1-bit)
        for c in range(split * CPS, tl.minimum(C, split * CPS + CPS)):
            kt = tl.load(kt_ptr + b * s_tb + c * s_tc)
            ks = tl.load(ks_ptr + b * s_tb + c * s_tc)
            vt = tl.load(vt_ptr + b * s_tb + c * s_tc)
            vs = tl.load(vs_ptr + b * s_tb + c * s_tc)
            if kt >= 0:
                k = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
                if kt == 0:
                    k = _fp16_tile(k_pools[0], k_strides[0], ks, h, G, D, BLOCK_G, BLOCK_D)
                elif kt == 1:
                    k = load_key_tile(k_pools[1], k_strides[1], centres_ptr, ks, h, G, D, BLOCK_G, BLOCK_D, K4_BITS, False)
                elif kt == 2:
                    k = load_key_tile(k_pools[2], k_strides[2], centres_ptr, ks, h, G, D, BLOCK_G, BLOCK_D, 2, False)
                else:
                    k = load_key_tile(k_pools[3], k_strides[3], centres_ptr, ks, h, G, D, BLOCK_G, BLOCK_D, 1, True)
                v = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
                if vt == 0:
                    v = _fp16_tile(v_pools[0], v_strides[0], vs, h, G, D, BLOCK_G, BLOCK_D)
                elif vt == 1:
                    v = load_value_tile(v_pools[1], v_strides[1], centres_ptr, vs, h, G, D, GROUP, BLOCK_G, BLOCK_D,
                                        V4_BITS, False, PACKED_V)  # fmt: skip
                elif vt == 2:
                    v = load_value_tile(v_pools[2], v_strides[2], centres_ptr, vs, h, G, D, GROUP, BLOCK_G, BLOCK_D,
                                        2, False, PACKED_V)  # fmt: skip
                else:
                    v = load_value_tile(v_pools[3], v_strides[3], centres_ptr, vs, h, G, D, GROUP, BLOCK_G, BLOCK_D,
                                        1, True, PACKED_V)  # fmt: skip
                # the model sees the dequantized values in its own (the query's) dtype, as the reference does
                k = k.to(q_ptr.dtype.element_ty).to(tl.float32)
                v = v.to(q_ptr.dtype.element_ty).to(tl.float32)
                m_i, l_i, acc = _online_update(q, k, v, in_chunk, m_i, l_i, acc, scaling, DOT_DTYPE, IEEE)

        # 3. the last split adds the FP16 tail and the new tokens
        if split == SPLITS - 1:
            n_tail = tl.load(tl_ptr + b * s_tl)
            tk = _fp16_tile(tk_ptr, s_t, b, h, G, D, BLOCK_G, BLOCK_D)  # a row's tail reads as one FP16 chunk
            tv = _fp16_tile(tv_ptr, s_t, b, h, G, D, BLOCK_G, BLOCK_D)
            m_i, l_i, acc = _online_update(q, tk, tv, (j < n_tail)[None, :], m_i, l_i, acc, scaling, DOT_DTYPE, IEEE)
            sj = tl.arange(0, BLOCK_S)
            n_off = b.to(tl.int64) * s_new[0] + h * s_new[1] + sj[:, None] * s_new[2] + d[None, :]
            n_mask = (sj[:, None] < S) & dm[None, :]
            nk = tl.load(k_ptr + n_off, mask=n_mask, other=0.0).to(tl.float32)
            nv = tl.load(v_ptr + n_off, mask=n_mask, other=0.0).to(tl.float32)  # key and value share a layout
            new_ok = tl.load(valid_ptr + b * S + sj, mask=sj < S, other=0) != 0
            seen = new_ok[None, :] & (sj[None, :] <= qi[:, None])
            m_i, l_i, acc = _online_update(q, nk, nv, seen, m_i, l_i, acc, scaling, DOT_DTYPE, IEEE)

        # 4. partial results of this split
        part = (b.to(tl.int64) * HKV + h) * SPLITS + split
        tl.store(o_ptr + part * BLOCK_R * D + r[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & dm[None, :])
        tl.store(m_ptr + part * BLOCK_R + r, m_i, mask=row_ok)
        tl.store(l_ptr + part * BLOCK_R + r, l_i, mask=row_ok)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_splits(batch: int, kv_heads: int, n_chunks: int, device: torch.device) -> int:
    """Split the chunk table so that about two programs run per multiprocessor (flash-decoding)."""
    if device.type != "cuda" or n_chunks == 0:
        return 1
    target = 2 * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(n_chunks, math.ceil(target / max(1, batch * kv_heads))))


TRITON_MAX_ROWS = 64
"""Most query rows (new tokens × query heads per KV head) one program of the Triton kernel
holds: it keeps them, and their scores against every new token, in registers. Decoding
(a token, or a few drafted ones) fits; a chunk of a prompt runs the tiled attention."""


def triton_fits(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the Triton kernel takes these queries (B, Hq, S, D) over keys (B, Hkv, S, D)."""
    return query.shape[1] // max(1, key.shape[1]) * query.shape[2] <= TRITON_MAX_ROWS


def _pools_and_strides(pools: list[torch.Tensor]) -> tuple[tuple, tuple]:
    """A component's pools (in :data:`POOL_ORDER`) as the Triton kernel takes them: (FP16 slots,
    then (codes, meta0, meta1) per packed tier) and their strides (the slots' first three, then
    (codes', metadata's) per packed tier; meta1 shares meta0's layout)."""
    packed = [quantized_pool(pools, t) for t in QUANTIZED_TIERS]
    torch._check(all(m1.stride() == m0.stride() for _, m0, m1 in packed), lambda: "meta0 and meta1 must share a layout")
    return (pools[0], *packed), (pools[0].stride()[:3], *((codes.stride(), m0.stride()) for codes, m0, _ in packed))


def mixed_attention_triton(
    query, key, value, new_valid, cache: PackedCache, scaling: float, n_splits: int | None = None
) -> torch.Tensor:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    require_triton()
    check_args(query, key, value, new_valid, cache)
    b, hq, s, d = query.shape
    hkv, g = key.shape[1], cache.chunk_size
    c = cache.k_tier.shape[1]
    gq = hq // hkv
    torch._check(
        triton_fits(query, key),
        lambda: f"{s} new tokens × {gq} query heads per KV head are more rows than the Triton kernel holds "
        f"({TRITON_MAX_ROWS}); mixed_attention_reference tiles them",
    )
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    k_pools = [t.contiguous() for t in cache.k_pools]
    v_pools = [t.contiguous() for t in cache.v_pools]
    # the tables as they are (a cache keeps them column-major): one layout for the four
    tables = cache.tables()
    if any(t.stride() != tables[0].stride() for t in tables):
        tables = [t.contiguous() for t in tables]
    tail_k, tail_v, tail_len = cache.tail_k.contiguous(), cache.tail_v.contiguous(), cache.tail_len.contiguous()
    value_group = cache.value_group
    splits = n_splits or default_splits(b, hkv, c, query.device)
    cps = max(1, math.ceil(c / splits))
    splits = max(1, math.ceil(c / cps)) if c else 1
    block_r = max(16, next_power_of_2(gq * s)) if not INTERPRET else next_power_of_2(gq * s)
    part_o = torch.empty(b, hkv, splits, block_r, d, dtype=torch.float32, device=query.device)
    part_m = torch.full((b, hkv, splits, block_r), -math.inf, dtype=torch.float32, device=query.device)
    part_l = torch.zeros(b, hkv, splits, block_r, dtype=torch.float32, device=query.device)
    _, centres = normal_tables(1, query.device)
    dot_dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(query.dtype, tl.float32)
    if INTERPRET and dot_dtype == tl.bfloat16:
        dot_dtype = tl.float32  # the interpreter has no bf16 matmul (numpy); GPUs multiply bf16 natively
    _mixed_attention_kernel[(b * hkv, splits)](
        (query, key, value), (query.stride()[:3], key.stride()[:3]), new_valid.to(torch.int8).contiguous(),
        *_pools_and_strides(k_pools), *_pools_and_strides(v_pools), centres,
        tuple(tables), tables[0].stride(), (tail_k, tail_v, tail_len), (tail_k.stride()[:3], tail_len.stride(0)),
        (part_o, part_m, part_l),
        hkv, gq, s, g, d, value_group, c, cps, splits, scaling,
        BLOCK_R=block_r, BLOCK_G=max(32, next_power_of_2(g)), BLOCK_S=max(16, next_power_of_2(s)),
        BLOCK_D=max(16, next_power_of_2(d)), DOT_DTYPE=dot_dtype, IEEE=dot_dtype == tl.float32,
        PACKED_V=packed_value_tiles(value_group, d), K4_BITS=tier_formats(k_pools)[INT4][0],
        V4_BITS=tier_formats(v_pools)[INT4][0],
    )  # fmt: skip
    # merge the splits by log-sum-exp
    m_max = part_m.amax(2, keepdim=True)
    m_safe = torch.where(torch.isinf(m_max), 0.0, m_max)
    w = torch.exp(part_m - m_safe)
    num = (w[..., None] * part_o).sum(2)
    den = (w * part_l).sum(2)
    # den is 0 only for a query that sees nothing (-> 0); a NaN from a NaN key propagates
    out = torch.where(den[..., None] == 0, 0.0, num / den.clamp(min=1e-30)[..., None])[:, :, : gq * s]
    # rows r = (head in group, token) -> (B, S, Hq, D)
    out = out.reshape(b, hkv, gq, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, hq, d)
    return out.to(query.dtype)

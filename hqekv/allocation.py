"""Tiers from a byte budget, without calibration: a rate-distortion choice at every re-rank (beyond the paper).

The paper fixes the share of chunks at each tier offline (SPEC §1.3, §1.5). Here
(``patch_model(model, bavg, ratios="auto")``, ``HqeKVConfig.allocation="rate-distortion"``)
every re-rank chooses, for each kept chunk, the tier of its keys and of its values (FP16, 4,
2, 1 bit) or its eviction, so that the real bytes of the chunks (codes and metadata) stay
within ``bavg`` bits per element and the expected damage to attention is smallest:

1. :func:`distortions`: the *measured* quantization error of each chunk at each tier (the
   cache's own quantizers on its own values, :func:`tier_error`), weighted by the attention
   of the window queries (the last m, as importance uses). The default, "retrieval" error
   model, reads attention as where a future query looks: a query that looks at token n
   (probability p_n) gets that token's error, so

   - values: ``D_V = Σ_q p_qn ‖Δv_n‖²``;
   - keys: a logit error s·q·Δk moves the output by about p·s·(q·Δk)·(v − o):
     ``D_K = Σ_q p_qn ‖v_n − o_q‖² s² Σ_d q_d² Δk_nd²`` (errors independent across channels);
   - eviction loses the token: ``D_E = Σ_q Σ_{n∈c} p_qn ‖v_n − o_q‖²``.

   The window's queries are a sample of the queries to come, not all of them: with
   :data:`PRIOR` > 0 each is priced as ``(1 − PRIOR)·p + PRIOR/N`` (:func:`with_prior`),
   a share of a future query's attention spread evenly over the N tokens it sees, so that
   evicting a chunk the window does not read still costs something. With
   :data:`NEXT_CHUNK` > 0 a chunk right after another costs at least that share of its
   predecessor's distortions (:func:`with_successors`): a question reads a needle's key
   words, its answer reads on into the value after them.

   The "output" model (``ERROR_MODEL``) is the exact first-order error of the window
   queries' outputs instead (p² per token, the coherent ``(P o − Σ p v)/(1 − P)`` of an
   eviction): on development text it concentrated bytes on the few chunks the window looks
   at and lost to "retrieval" (docs/results.md).
2. :func:`allocate`: per row, one Lagrange multiplier λ prices a byte; each chunk takes the
   choice of least ``D + λ·bytes`` (reverse water-filling over chunks, keys and values
   apart), and λ is the smallest, found by bisection, whose choices fit the budget.
3. :func:`share`: one budget for the model. After a multi-token input (a prompt, a chunk of
   one) each layer has re-ranked within :data:`PROVISIONAL` times its share and left its
   choices (:class:`LayerChoices`); the cache then prices a byte once for all layers, with
   each layer's distortions relative to its window output energy, and each layer keeps the
   share it ends with for its decode re-ranks. With :data:`LAYER_FLOOR` > 0 no layer is
   left with less than that share of its own budget (an ablation, 0 by default). With
   ``HqeKVConfig.layer_bits`` each layer keeps its own budget instead, which
   :func:`split_budget` makes from the layers' measured sensitivities (a calibration's
   ``layer_sensitivity``).

Chunks only move down (a chunk already at 2 bits can stay or go lower; what it lost is
sunk), and the chunks in the top ``protected`` under either importance metric are never
evicted. Everything here is a pure function of tensors.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass
from typing import Sequence

import torch

from . import quantization
from .config import check_bavg
from .tiers import EVICTED, FP16, INT1, QUANTIZED_TIERS, TIERS, TILE_CHUNKS

ERROR_MODEL = "retrieval"
"""How :func:`distortions` weighs errors by attention: "retrieval" (the default) or "output"."""
LAYER_SCALE = "energy"
"""How the cache shares the budget between layers (:func:`share`): "energy" (the default),
one price of a byte for distortions relative to each layer's window output energy; "off",
every layer keeps ``bavg`` (an ablation)."""
LAYER_STRENGTH = 0.5
"""Strength γ of the split of a budget over the layers by their measured sensitivity
(:func:`hqekv.calibration.split_budget`) when the allocator runs with a calibration's
``layer_sensitivity`` (each layer its own budget, ``HqeKVConfig.layer_bits``): chosen on
development text (docs/results.md, "Layers at budgets split by their measured sensitivity")."""
PROVISIONAL = 2.0
"""A multi-token input first keeps each layer within this many times its budget share; right
after the forward, the cache shares the model's budget between its layers
(:func:`share`), moving chunks only down, so a layer can end with up to this share."""
DEFERRED_WAIT = "int4"
"""How the cache holds a prompt's chunks while it arrives in pieces
(:meth:`~hqekv.cache.HqeKVCache.defer_eviction` until ``settle``): nothing is evicted before
the prompt's end is seen, and

- "int4" (the default): every chunk waits at the 4-bit tier (keys at 8 bits,
  :data:`hqekv.cache.rerank.WAITING_BITS`) but the protected ones (FP16), as under
  fixed ratios, so that the prompt's end can still place any chunk at any tier below FP16;
  the transient is the codes and their metadata, about 6.75 bits per element (9 for the
  keys, 4.5 for the values at a value group of 64);
- "budget": the allocator chooses within :data:`DEFERRED` times the budget, the layers
  sharing it after each piece; chunks the early pieces' windows do not read fall to 2 and
  1 bit, and the prompt's end cannot bring them back (an ablation: docs/results.md, "The
  allocator's allowance while a prompt arrives in pieces").

Either allowance is real memory, counted by the memory report, on top of what the prompt
settles to."""
DEFERRED = 2.0
"""Under ``DEFERRED_WAIT = "budget"``, the model's budget times this is what the cache may
hold while a prompt arrives in pieces."""
DEFERRED_PRIOR = 0.0
""":data:`PRIOR` while a prompt arrives in pieces, under ``DEFERRED_WAIT = "budget"`` (the
allocator does not choose before ``settle`` otherwise): the window of an early piece is a poor
sample of the queries the prompt's end will ask, so its chunks may be priced with more of a
future query's attention spread evenly (1: evenly alone)."""
LAYER_FLOOR = 0.0
"""Under a shared budget (:func:`share`), the least share of its own budget each layer keeps:
0 lets the one price of a byte leave a layer with as little as it decides."""
PRIOR = 0.0
"""Share of a future query's attention the window queries are not taken to predict, spread
evenly over the tokens it sees (:func:`with_prior`): 0 prices every chunk by the window's
attention alone."""
NEXT_CHUNK = 0.0
"""A chunk right after another costs at least this share of what its predecessor costs
(:func:`with_successors`): what the window's queries read, an answer reads on from (an
ablation, 0 by default: docs/results.md, "Needles the allocator drops")."""
HEAD_EVICTION = "chunk"
"""Under ``head_tiers``, what a chunk's KV heads choose apart: "chunk" (the default), their
tiers, the chunk being evicted for all of them or for none (their eviction distortions
summed against what their tiers cost); "head", eviction too (an ablation)."""
KL_FLOOR = 1e-9
"""The least KL a log is taken of (ln(max(KL, KL_FLOOR)) in the calibration's data term, the
layers' sensitivities in :func:`split_budget`): all-FP16 scores exactly 0 KL."""
BISECTION_STEPS = 48
LAMBDA_RANGE = (-14.0, 14.0)
"""log10 of the price of a byte the bisection searches, with distortions and bytes of a row
normalized to at most 1."""


def tier_error(
    chunks: torch.Tensor, tier: int, component_is_key: bool, value_group: int, meta_dtype: torch.dtype
) -> torch.Tensor:
    """Squared error of each element of ``chunks`` stored at quantized ``tier``, as the cache stores it.

    chunks (N, H, G, D) -> (N, H, G, D) float32: the quantizers of :mod:`hqekv.quantization`
    with the cache's groups (keys per channel, values per token) and metadata dtype.
    """
    x = chunks.float()
    spec = TIERS[tier]
    grouped = quantization.key_groups(x) if component_is_key else quantization.value_groups(x, value_group)
    codes, m0, m1 = quantization.quantize(grouped, spec.code_bits, spec.method, meta_dtype)
    back = quantization.dequantize(codes, m0, m1, spec.code_bits, spec.method, torch.float32)
    back = quantization.key_chunks(back) if component_is_key else quantization.value_chunks(back)
    return (back - x).square()


ERROR_BATCH = 2**19
"""Elements (of whole chunks, at least one) :func:`tile_distortions` measures quantization
errors of at a time: the quantizers' float32 temporaries are a few MiB, whatever the tile."""


def distortions(
    probs: torch.Tensor,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    n_chunks: int,
    chunk_size: int,
    scaling: float,
    value_group: int,
    meta_dtype: torch.dtype,
    error_model: str = "retrieval",
    tile: int = TILE_CHUNKS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expected squared attention-output error of each choice for each chunk (see the module doc).

    probs (B, Hkv, g, m, N) float32 window probabilities (:func:`hqekv.importance.window_probabilities`);
    queries (B, Hkv·g, m, D), keys, values (B, Hkv, N, D), the first ``n_chunks·chunk_size``
    tokens being the chunks (the rest, the tail, is attended but not allocated).
    -> d_k, d_v (B, C, 4) float32 for keys / values at FP16, 4, 2, 1 bit (FP16: 0),
    d_evict (B, C) float32, and the energy (B,) of the window outputs, Σ‖o_q‖². Sums over
    query heads and window queries. Works on ``tile`` chunks at a time (a cache too long to
    hold dequantized goes through :func:`window_outputs` and :func:`tile_distortions` tile
    by tile instead).
    """
    n, step = probs.shape[-1], tile * chunk_size
    out = sum(  # o_q: (B, Hkv, g, m, D)
        window_outputs(probs[..., t : t + step], values[:, :, t : t + step]) for t in range(0, n, step)
    )
    b = keys.shape[0]
    d_k, d_v = keys.new_zeros(2, b, n_chunks, 4, dtype=torch.float32)
    d_evict = keys.new_zeros(b, n_chunks, dtype=torch.float32)
    for c0 in range(0, n_chunks, tile):
        c1 = min(c0 + tile, n_chunks)
        tokens = slice(c0 * chunk_size, c1 * chunk_size)
        d_k[:, c0:c1], d_v[:, c0:c1], d_evict[:, c0:c1] = tile_distortions(
            probs[..., tokens], queries, keys[:, :, tokens], values[:, :, tokens], out, chunk_size, scaling,
            value_group, meta_dtype, error_model,
        )  # fmt: skip
    return d_k, d_v, d_evict, out.square().sum((1, 2, 3, 4))


def with_prior(probs: torch.Tensor, visible: torch.Tensor, seen: torch.Tensor, prior: float) -> torch.Tensor:
    """The window probabilities a future query is priced with: ``(1 − prior)·p + prior/N``.

    probs (B, Hkv, g, m, n) float32 of some tokens, visible (B, m, n) bool of them, seen
    (B, m) how many tokens each window query sees in the whole cache -> (B, Hkv, g, m, n);
    ``prior``: :data:`PRIOR`, or :data:`DEFERRED_PRIOR` for a prompt in pieces. The window's
    last queries are a sample of the queries to come; a share of the attention of those is
    not where the window looks, and with nothing known of it it is spread evenly: eviction
    is priced for every chunk, not only for those the window reads.
    """
    if prior == 0:
        return probs
    even = visible.float() / seen.clamp(min=1)[..., None].float()  # (B, m, n)
    return (1 - prior) * probs + prior * even[:, None, None]


def with_successors(
    d_k: torch.Tensor, d_v: torch.Tensor, d_evict: torch.Tensor, chunk_pos: torch.Tensor, share: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distortions (B, C, 4), (B, C, 4), (B, C) of chunks at ``chunk_pos`` (B, C) (ascending,
    -1 where empty), each at least ``share`` times its predecessor's where that chunk is the
    one before it: a needle's value follows the words the question reads."""
    if share == 0:
        return d_k, d_v, d_evict
    before = chunk_pos.roll(1, 1)  # the first column's wraps around and is never a predecessor
    follows = (chunk_pos == before + 1) & (before >= 0)
    follows[:, 0] = False
    return tuple(
        torch.where(follows.view(*follows.shape, *[1] * (d.dim() - 2)), torch.maximum(d, share * d.roll(1, 1)), d)
        for d in (d_k, d_v, d_evict)
    )


def window_outputs(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The window queries' attention outputs over some tokens: probs (B, Hkv, g, m, n) float32,
    values (B, Hkv, n, D) -> (B, Hkv, g, m, D) float32; summed over the tiles of a cache, the
    outputs o_q :func:`tile_distortions` needs."""
    return torch.einsum("bhgmn,bhnd->bhgmd", probs, values.float())


def tile_distortions(
    probs: torch.Tensor,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    out: torch.Tensor,
    chunk_size: int,
    scaling: float,
    value_group: int,
    meta_dtype: torch.dtype,
    error_model: str = "retrieval",
    k_tier: torch.Tensor | None = None,
    v_tier: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`distortions` of the nc whole chunks of one tile of a cache.

    probs (B, Hkv, g, m, n) float32: the window probabilities of the tile's n = nc·G tokens
    (normalized over the whole cache); queries (B, Hkv·g, m, D); keys, values (B, Hkv, n, D);
    out (B, Hkv, g, m, D): the window outputs over the whole cache (:func:`window_outputs`).
    k_tier, v_tier (B, nc): the chunks' current tiers, when given: errors are measured only
    at the tiers below them (the only ones :func:`allocate` can move a chunk to; a chunk
    re-quantized at its own tier is unchanged, so its error there is 0), none where there
    is no chunk (a negative tier or EVICTED).
    -> d_k, d_v (B, nc, 4), d_evict (B, nc) float32.
    """
    b, hkv, g, m, n = probs.shape
    d, gs = keys.shape[-1], chunk_size
    nc = n // gs
    q2 = queries.float().reshape(b, hkv, g, m, d).square()
    p, v = probs, values.float()
    p2 = p.square() if error_model == "output" else p
    # ‖v_n − o_q‖² for every query and token
    out_sq = out.square().sum(-1)[..., None]
    spread = (v.square().sum(-1)[:, :, None, None, :] - 2 * torch.einsum("bhnd,bhgmd->bhgmn", v, out) + out_sq)
    spread = spread.clamp(min=0)
    key_weight = torch.einsum("bhgmn,bhgmd->bhnd", p2 * spread, q2) * scaling**2  # (B, Hkv, n, D)
    value_weight = p2.sum((2, 3))  # (B, Hkv, n)

    def chunked(x: torch.Tensor) -> torch.Tensor:  # (B, Hkv, n, ...) -> (B, nc, Hkv, G, ...)
        return x.reshape(b, hkv, nc, gs, *x.shape[3:]).transpose(1, 2)

    k_chunks = chunked(keys).reshape(b * nc, hkv, gs, d)
    v_chunks = chunked(v).reshape(b * nc, hkv, gs, d)
    k_weight = chunked(key_weight).reshape(b * nc, hkv, gs, d)
    v_weight = chunked(value_weight).reshape(b * nc, hkv, gs)
    d_k, d_v = keys.new_zeros(2, b * nc, 4, dtype=torch.float32)
    batch = max(1, ERROR_BATCH // (hkv * gs * d))
    every = torch.arange(b * nc, device=keys.device)
    for is_key, chunks, weight, current, into in (
        (True, k_chunks, k_weight, k_tier, d_k),
        (False, v_chunks, v_weight, v_tier, d_v),
    ):
        current = None if current is None else current.reshape(b * nc)
        for t in QUANTIZED_TIERS:
            which = every if current is None else ((current >= 0) & (current < t)).nonzero()[:, 0]
            for part in which.split(batch):  # the quantizers' temporaries are a batch's, not the tile's
                err = tier_error(chunks[part], t, is_key, value_group, meta_dtype)
                into[part, t] = (err * weight[part]).sum((1, 2, 3)) if is_key else (err.sum(-1) * weight[part]).sum((1, 2))
    d_k, d_v = d_k.reshape(b, nc, 4), d_v.reshape(b, nc, 4)
    if error_model == "retrieval":
        d_evict = (p * spread).reshape(b, hkv, g, m, nc, gs).sum((1, 2, 3, 5))
    else:
        # (P_q o_q − Σ_{n∈c} p_qn v_n) / (1 − P_q) per query, chunk and head
        p_chunks = p.reshape(b, hkv, g, m, nc, gs)
        mass = p_chunks.sum(-1)  # (B, Hkv, g, m, nc)
        held = torch.einsum("bhgmcs,bhcsd->bhgmcd", p_chunks, v.reshape(b, hkv, nc, gs, d))
        shift = (mass[..., None] * out[:, :, :, :, None, :] - held).square().sum(-1)
        d_evict = (shift / (1 - mass).clamp(min=1e-6).square()).sum((1, 2, 3))
    return d_k, d_v, d_evict


def chunk_bytes(
    heads: int,
    chunk_size: int,
    head_dim: int,
    value_group: int,
    fp_bytes: int,
    meta_bytes: int,
    device: torch.device | str | None = None,
    widths: tuple[dict[int, int], dict[int, int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Real bytes of one chunk's keys and of its values at FP16, 4, 2, 1 bit: (4,), (4,) float64
    on ``device`` (the cache's: tier tables index them).

    Codes are packed into int32 words along each group (:mod:`hqekv.packing`); every group
    has a 2-element metadata pair. Keys: one group per channel over the chunk's tokens;
    values: one group per token and ``value_group`` channels. ``widths``: the code bits of
    each quantized tier of the keys' and of the values' pools where they are not the tier's
    own (a prompt's waiting chunks, :data:`~hqekv.tiers.WIDE_BITS`).
    """
    elements = heads * chunk_size * head_dim
    key_groups, key_len = heads * head_dim, chunk_size
    value_groups, value_len = heads * chunk_size * (head_dim // value_group), value_group
    k, v = [float(elements * fp_bytes)], [float(elements * fp_bytes)]
    for t in QUANTIZED_TIERS:
        for out, groups, length, width in ((k, key_groups, key_len, widths and widths[0]),
                                           (v, value_groups, value_len, widths and widths[1])):  # fmt: skip
            bits = width[t] if width else TIERS[t].code_bits
            words = -(-length * bits // 32)
            out.append(float(groups * (4 * words + 2 * meta_bytes)))
    return torch.tensor(k, dtype=torch.float64, device=device), torch.tensor(v, dtype=torch.float64, device=device)


def ratio_bits(config, head_dim: int, kv_dtype: torch.dtype) -> float:
    """Real bits per element of chunk storage that ``config``'s tier shares spend, as
    :func:`chunk_bytes` counts them (codes and metadata; evicted chunks count 0), averaged
    over keys and values and over its per-layer budgets, for a model of ``head_dim`` whose
    keys and values are ``kv_dtype``: the budget at which the allocator spends what the
    shares do. The protected FP16 chunks on top of the shares are not counted.
    """
    value_group = min(config.value_group, head_dim)
    fp_bytes = config.resolve_fp_dtype(kv_dtype).itemsize
    meta_bytes = config.resolve_metadata_dtype(kv_dtype).itemsize
    bytes_k, bytes_v = chunk_bytes(1, config.chunk_size, head_dim, value_group, fp_bytes, meta_bytes)
    elements = config.chunk_size * head_dim

    def spent(shares, per_tier: torch.Tensor) -> float:  # per_tier stops before the evicted share: it costs nothing
        return sum(share * float(b) for share, b in zip(shares.as_tuple(), per_tier))

    layers = config.layer_ratios or (config.ratios,)
    per_layer = [spent(config.key_ratios or r, bytes_k) + spent(r, bytes_v) for r in layers]
    return sum(per_layer) / len(per_layer) * 8 / (2 * elements)


def allocate(
    d_k: torch.Tensor,
    d_v: torch.Tensor,
    d_evict: torch.Tensor,
    bytes_k: torch.Tensor,
    bytes_v: torch.Tensor,
    k_tier: torch.Tensor,
    v_tier: torch.Tensor,
    evictable: torch.Tensor,
    budget: torch.Tensor,
    fixed: torch.Tensor | None = None,
    group: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V tier of every chunk that minimise the distortion within ``budget`` bytes per row.

    d_k, d_v (B, C, 4), d_evict (B, C) float: from :func:`distortions`; bytes_k, bytes_v (4,)
    from :func:`chunk_bytes`; k_tier, v_tier (B, C) int64: current tiers (-1 or EVICTED where
    no chunk); tiers only move down, and the distortion a chunk already has at its tier is
    sunk: each choice costs what it adds to it;
    evictable (B, C) bool; budget (B,) bytes for the chunks; fixed (B, C) bool, when given:
    chunks that keep their tiers (their bytes count against the budget); group (C,) int64,
    when given: columns with one id are parts of one chunk (its KV heads, ``head_tiers``),
    evicted together, where all of them may be and their eviction distortions together are
    below what their cheapest tiers cost.
    -> new k_tier, v_tier (B, C) int64, EVICTED at the same places in both.

    One λ per row, by bisection on log λ: the smallest price of a byte whose choices fit the
    budget. When even the cheapest choices do not fit (protected chunks at 1 bit), those are taken.
    """
    device = d_k.device
    valid = (k_tier >= 0) & (k_tier != EVICTED)
    tiers = torch.arange(4, device=device)
    # normalize each row: distortions to at most 1, bytes to a chunk's FP16 keys + values
    scale = torch.cat([d_k.flatten(1), d_v.flatten(1), d_evict], 1).masked_fill(
        ~torch.cat([valid.repeat_interleave(4, 1)] * 2 + [valid], 1), 0
    ).amax(1).clamp(min=1e-30)[:, None, None].double()
    unit = float(bytes_k[FP16] + bytes_v[FP16])
    dk, dv, de = d_k.double() / scale, d_v.double() / scale, d_evict.double() / scale[:, :, 0]
    bk, bv = bytes_k.to(device) / unit, bytes_v.to(device) / unit
    # a tier above the current one is not a choice (chunks only move down), and staying costs
    # nothing: a chunk that keeps its tier keeps its codes
    allowed_k = tiers[None, None, :] >= k_tier.clamp(0, INT1)[..., None]
    allowed_v = tiers[None, None, :] >= v_tier.clamp(0, INT1)[..., None]
    cur_k, cur_v = k_tier.clamp(0, INT1)[..., None], v_tier.clamp(0, INT1)[..., None]
    if fixed is not None:
        allowed_k &= ~fixed[..., None] | (tiers == cur_k)
        allowed_v &= ~fixed[..., None] | (tiers == cur_v)
        evictable = evictable & ~fixed
    held_k, held_v = dk.gather(2, cur_k), dv.gather(2, cur_v)
    dk, dv = (dk - held_k).clamp(min=0), (dv - held_v).clamp(min=0)
    de = (de - held_k[..., 0] - held_v[..., 0]).clamp(min=0)
    can_evict = evictable & valid
    limit = budget.double() / unit
    if group is not None:
        group = group.to(device)
        parts = int(group.max()) + 1 if group.numel() else 0
        # a group may go where every part of it may and at least one is there
        blocked = torch.zeros(valid.shape[0], parts, device=device).index_add_(1, group, (valid & ~can_evict).float())
        present = torch.zeros_like(blocked).index_add_(1, group, valid.float())
        can_evict = valid & ((blocked == 0) & (present > 0))[:, group]

    def choose(log_price: torch.Tensor):
        price = torch.pow(10.0, log_price)[:, None, None]
        cost_k = (dk + price * bk).masked_fill(~allowed_k, float("inf"))
        cost_v = (dv + price * bv).masked_fill(~allowed_v, float("inf"))
        best_k, tk = cost_k.min(-1)
        best_v, tv = cost_v.min(-1)
        if group is None:
            evict = can_evict & (de < best_k + best_v)
        else:
            gain = torch.where(can_evict, best_k + best_v - de, 0.0)
            evict = can_evict & (torch.zeros(gain.shape[0], parts, dtype=gain.dtype, device=device)
                                 .index_add_(1, group, gain) > 0)[:, group]  # fmt: skip
        used = torch.where(evict | ~valid, 0.0, bk[tk] + bv[tv]).sum(1)
        return tk, tv, evict, used

    lo = torch.full_like(limit, LAMBDA_RANGE[0])
    hi = torch.full_like(limit, LAMBDA_RANGE[1])
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        fits = choose(mid)[3] <= limit
        hi = torch.where(fits, mid, hi)
        lo = torch.where(fits, lo, mid)
    tk, tv, evict, _ = choose(hi)
    gone = evict | ~valid
    return tk.masked_fill(gone, EVICTED), tv.masked_fill(gone, EVICTED)


@dataclass
class LayerChoices:
    """One layer's choices at a re-rank, kept until the cache shares the budget between layers.

    d_k, d_v (B, C, 4), d_evict (B, C): :func:`distortions` of the chunks of the layer's
    table (columns as in its live table); k_tier, v_tier (B, C): their tiers; evictable
    (B, C) bool; budget (B,) bytes: the layer's share of the budget; energy (B,): the
    squared norm of its window outputs, which makes distortions of layers comparable.
    """

    d_k: torch.Tensor
    d_v: torch.Tensor
    d_evict: torch.Tensor
    k_tier: torch.Tensor
    v_tier: torch.Tensor
    evictable: torch.Tensor
    budget: torch.Tensor
    energy: torch.Tensor
    group: torch.Tensor | None = None

    def kept(self, keep: torch.Tensor, k_tier: torch.Tensor, v_tier: torch.Tensor) -> "LayerChoices":
        """These choices after a move to ``k_tier``, ``v_tier`` (B, C) that kept the chunks
        ``keep`` (B, C) bool, compacted to the left as the layer compacts its table."""
        b, c = keep.shape
        width = int(keep.sum(1).max()) if b else 0
        rows, cols = keep.nonzero(as_tuple=True)
        dest = (keep.long().cumsum(1) - 1)[rows, cols]

        def compact(x: torch.Tensor, fill) -> torch.Tensor:
            out = x.new_full((b, width, *x.shape[2:]), fill)
            out[rows, dest] = x[rows, cols]
            return out

        return LayerChoices(
            compact(self.d_k, 0), compact(self.d_v, 0), compact(self.d_evict, 0), compact(k_tier, -1),
            compact(v_tier, -1), compact(self.evictable, False), self.budget, self.energy,
        )  # fmt: skip


    def joined(self, split: int) -> "LayerChoices":
        """These choices of a layer whose KV heads are rows of their own (``split`` storage rows
        per batch row, (B·split, C)) as one row per batch row (B, split·C), with the heads'
        budgets and energies summed: one price of a byte for all heads of a row, so bytes
        move to the heads where they lower the error most (``config.head_tiers``).
        :func:`split_rows` takes the chosen tiers back."""
        if split == 1:
            return self

        def join(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(x.shape[0] // split, split * x.shape[1], *x.shape[2:])

        per_row = (self.d_k, self.d_v, self.d_evict, self.k_tier, self.v_tier, self.evictable)
        sums = (x.reshape(-1, split).sum(1) for x in (self.budget, self.energy))
        c = self.d_k.shape[1]  # a column of each head's row holds the same chunk while they evict together
        group = torch.arange(split * c, device=self.d_k.device) % c if HEAD_EVICTION == "chunk" else None
        return LayerChoices(*(join(x) for x in per_row), *sums, group)


def split_rows(tiers: torch.Tensor, split: int) -> torch.Tensor:
    """Tiers (B, split·C) of :meth:`LayerChoices.joined` rows as (B·split, C), a storage row each."""
    return tiers.reshape(tiers.shape[0] * split, tiers.shape[1] // split)


def tier_bytes(k_tier: torch.Tensor, v_tier: torch.Tensor, bytes_k: torch.Tensor, bytes_v: torch.Tensor) -> torch.Tensor:
    """Bytes per row (B,) of the chunks at ``k_tier``, ``v_tier`` (B, C); none where there is no chunk."""
    kept = (k_tier >= 0) & (k_tier != EVICTED)
    held = bytes_k.to(k_tier.device)[k_tier.clamp(0, INT1)] + bytes_v.to(k_tier.device)[v_tier.clamp(0, INT1)]
    return torch.where(kept, held, 0.0).sum(1)


def share(
    layers: list[LayerChoices], bytes_k: torch.Tensor, bytes_v: torch.Tensor, floor: float | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K and V tiers of every layer's chunks under one budget for the model (per row).

    Each layer's distortions are divided by its window output energy (an error relative to
    what the layer's attention outputs), then one λ per row prices a byte in every layer:
    budget moves to the layers where it lowers the error most. The budget is the sum of the
    layers' ``budget``. ``floor`` (:data:`LAYER_FLOOR` when None): no layer is left with
    less than that share of its own ``budget`` where it can hold it; a layer the one price
    leaves below is given its floor alone, and the rest of the budget is shared again
    among the others (until none falls below).
    -> [(k_tier, v_tier) (B, C_l)] in the order of ``layers``.
    """
    floor = LAYER_FLOOR if floor is None else floor
    widths = [x.d_k.shape[1] for x in layers]
    columns = [slice(a - w, a) for a, w in zip(itertools.accumulate(widths), widths)]
    norm = [x.energy.clamp(min=1e-30)[:, None] for x in layers]
    d_k = torch.cat([x.d_k / n[..., None] for x, n in zip(layers, norm)], 1)
    d_v = torch.cat([x.d_v / n[..., None] for x, n in zip(layers, norm)], 1)
    d_evict = torch.cat([x.d_evict / n for x, n in zip(layers, norm)], 1)
    k_tier = torch.cat([x.k_tier for x in layers], 1)
    v_tier = torch.cat([x.v_tier for x in layers], 1)
    evictable = torch.cat([x.evictable for x in layers], 1)
    fixed = torch.zeros_like(evictable)
    total = sum(x.budget for x in layers)
    group = None
    if any(x.group is not None for x in layers):  # each layer's chunks their own groups
        ids = [torch.arange(w, device=d_k.device) if x.group is None else x.group.to(d_k.device) for x, w in zip(layers, widths)]
        group = torch.cat([i + a - w for i, a, w in zip(ids, itertools.accumulate(widths), widths)])
    for _ in range(len(layers) + 1):
        k, v = allocate(d_k, d_v, d_evict, bytes_k, bytes_v, k_tier, v_tier, evictable, total, fixed, group)
        if floor <= 0:
            break
        moved = False
        for x, cols in zip(layers, columns):
            short = ~fixed[:, cols].any(1) & (tier_bytes(k[:, cols], v[:, cols], bytes_k, bytes_v) < floor * x.budget)
            if short.any():
                own_k, own_v = allocate(x.d_k, x.d_v, x.d_evict, bytes_k, bytes_v, x.k_tier, x.v_tier, x.evictable,
                                        floor * x.budget, group=x.group)  # fmt: skip
                k_tier[short, cols], v_tier[short, cols] = own_k[short], own_v[short]
                fixed[short, cols] = True
                moved = True
        if not moved:
            break
    return list(zip(k.split(widths, 1), v.split(widths, 1)))


def split_budget(bavg: float, sensitivity: Sequence[float], strength: float) -> list[float]:
    """Per-layer budgets averaging ``bavg``: b_l = c + γ·½·log2(s_l / geomean(s)), clipped
    to [bavg/4, min(16, 3·bavg)], with c set so that the mean is ``bavg``.

    γ = 1 is the classic reverse water-filling of bits: if a layer's loss is s_l·4^(−b_l)
    (each bit quarters the quantization noise power), that split minimises the sum. The
    tiers' real curves differ (eviction is not quantization), so γ is searched.
    """
    bavg = check_bavg(bavg)
    if strength < 0 or not math.isfinite(strength):
        raise ValueError(f"strength must be a finite number >= 0, got {strength!r}")
    logs = [math.log2(max(s, KL_FLOOR)) for s in sensitivity]
    mean_log = statistics.fmean(logs)
    d = [strength * 0.5 * (x - mean_log) for x in logs]
    lo, hi = bavg / 4, min(16.0, 3 * bavg)

    def budgets(c):
        return [min(hi, max(lo, c + x)) for x in d]

    a, z = lo - max(d), hi - min(d)  # the mean is lo at a and hi at z, monotone between
    for _ in range(100):
        c = (a + z) / 2
        a, z = (c, z) if statistics.fmean(budgets(c)) < bavg else (a, c)
    return budgets((a + z) / 2)

"""Joint K-V importance (paper §3.2, SPEC §1.2): window attention -> metric_K, metric_V -> chunk scores."""

from __future__ import annotations

import torch


def window_probabilities(
    queries: torch.Tensor,
    query_pos: torch.Tensor,
    query_valid: torch.Tensor,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    key_valid: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each window query over the cached tokens, per query head.

    queries (B, Hq, m, D) after RoPE; query_pos (B, m) int; query_valid (B, m) bool.
    keys (B, Hkv, N, D) after RoPE; key_pos (B, N) int; key_valid (B, N) bool.
    -> probs (B, Hkv, Hq/Hkv, m, N) float32, 0 where a query cannot see a token (a query
    that sees nothing is all 0), and visible (B, m, N) bool.
    """
    return _window_probabilities(queries, query_pos, query_valid, keys, key_pos, key_valid, scaling, None)


def _window_logits(queries, query_pos, query_valid, keys, key_pos, key_valid, scaling):
    """Yields each KV head's masked logits (B, g, m, N) float32 (-inf where a query cannot
    see a token), after the visibility (B, m, N) bool: the temporaries are a head's, not the
    layer's."""
    b, hq, m, d = queries.shape
    hkv = keys.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    q = queries.float().reshape(b, hkv, hq // hkv, m, d)
    visible = (
        key_valid[:, None, :]
        & query_valid[:, :, None]
        & (key_pos[:, None, :] <= query_pos[:, :, None])
    )  # (B, m, N)
    yield visible
    for h in range(hkv):
        logits = torch.einsum("bgmd,bnd->bgmn", q[:, h], keys[:, h].float()) * scaling
        yield logits.masked_fill(~visible[:, None], -float("inf"))


def _window_probabilities(queries, query_pos, query_valid, keys, key_pos, key_valid, scaling, lse, held=None):
    """:func:`window_probabilities`; with ``lse`` (B, Hkv, g, m), normalized by it instead of
    over ``keys`` alone (``keys`` being one tile of the cache); ``held``: that tile's
    visibility and logits, computed before (:func:`window_lse`)."""
    b, hq, m, _ = queries.shape
    hkv = keys.shape[1]
    heads = iter(held) if held is not None else _window_logits(queries, query_pos, query_valid, keys, key_pos,
                                                               key_valid, scaling)  # fmt: skip
    visible = next(heads)
    probs = queries.new_empty(b, hkv, hq // hkv, m, keys.shape[2], dtype=torch.float32)
    for h, logits in enumerate(heads):
        if lse is None:
            probs[:, h] = torch.softmax(logits, dim=-1).nan_to_num(0.0)
        else:  # a query that sees nothing has lse -inf: its probabilities are 0, not NaN
            probs[:, h] = torch.exp(logits - lse[:, h, ..., None]).nan_to_num(0.0)
    return probs, visible


def window_lse(queries, query_pos, query_valid, tiles, scaling, held: dict | None = None) -> torch.Tensor:
    """The log of each window query's softmax denominator over a cache given tile by tile.

    queries, query_pos, query_valid as :func:`window_probabilities`; ``tiles``: an iterable of
    (start, keys, values, key_pos, key_valid) as :func:`window_probabilities` takes the keys
    (values unused, may be None). -> (B, Hkv, g, m) float32, -inf for a query that sees nothing.
    ``held``: a dict that keeps each tile's visibility and logits by its start, for
    :func:`window_tiles` to reuse instead of computing them again (the caller bounds their
    bytes: :class:`hqekv.cache.rerank.TileReader`).
    """
    total = None
    for start, keys, _, key_pos, key_valid in tiles:
        heads = _window_logits(queries, query_pos, query_valid, keys, key_pos, key_valid, scaling)
        if held is not None:
            heads = held[start] = list(heads)
        heads = iter(heads)
        next(heads)
        lse = torch.stack([torch.logsumexp(logits, dim=-1) for logits in heads], dim=1)
        total = lse if total is None else torch.logaddexp(total, lse)
    return total


def window_tiles(queries, query_pos, query_valid, tiles, scaling, lse, held: dict | None = None):
    """:func:`window_probabilities` over a cache given tile by tile, never held whole.

    ``tiles`` as :func:`window_lse` takes them (values needed), ``lse`` what it returned for
    the same cache, ``held`` what it kept there (the same results, not computed again).
    Yields (start, keys, values, probs, visible) per tile: probs (B, Hkv, g, m, n) float32
    and visible (B, m, n) of the tile's n tokens, as :func:`window_probabilities` gives those
    columns for the whole cache (up to rounding).
    """
    for start, keys, values, key_pos, key_valid in tiles:
        probs, visible = _window_probabilities(
            queries, query_pos, query_valid, keys, key_pos, key_valid, scaling, lse, (held or {}).get(start)
        )  # fmt: skip
        yield start, keys, values, probs, visible


def window_query_attention(
    queries: torch.Tensor,
    query_pos: torch.Tensor,
    query_valid: torch.Tensor,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    key_valid: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Attention the last m queries pay to each cached token, per KV head.

    Arguments as :func:`window_probabilities`.
    -> (B, Hkv, N) float32: per token, the softmax weights summed over the queries that can
    see it causally, divided by how many of them do; query heads of a KV group averaged.
    """
    probs, visible = window_probabilities(queries, query_pos, query_valid, keys, key_pos, key_valid, scaling)
    return per_token_attention(probs, visible)


def per_token_attention(probs: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, g, m, N) window probabilities, (B, m, N) visibility -> (B, Hkv, N) the paper's
    per-token attention (:func:`window_query_attention`)."""
    seen_by = visible.sum(1).clamp(min=1)  # (B, N)
    per_token = probs.sum(3) / seen_by[:, None, None, :]  # (B, Hkv, g, N)
    return per_token.mean(2)


def token_metrics(attention: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """metric_K = attention; metric_V = attention · range(V), both summed over KV heads.

    attention (B, Hkv, N) float32, values (B, Hkv, N, D) -> metric_k, metric_v (B, N) float32.
    """
    vf = values.float()
    value_range = vf.amax(-1) - vf.amin(-1)
    return attention.sum(1), (attention * value_range).sum(1)


def chunk_scores(token_scores: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Mean token score of each chunk: (B, C·G) -> (B, C)."""
    b, n = token_scores.shape
    if n % chunk_size:
        raise ValueError(f"{n} tokens do not split into chunks of {chunk_size}")
    return token_scores.reshape(b, n // chunk_size, chunk_size).mean(-1)


def random_scores(chunk_pos: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The control of the importance metric: a fixed pseudo-random score per chunk, for K and for V.

    chunk_pos (B, C) int64 logical chunk indices -> score_k, score_v (B, C) float32 in [0, 1).
    A hash of (layer, chunk index, component): the same chunk keeps its score at every
    re-rank, so tiers move down as rarely as under the real metric and the control holds
    the tier counts of the ratios, not a drift of re-drawn orders.
    """
    out = []
    for salt in (0x9E3779B1, 0x85EBCA77):
        h = (chunk_pos.clamp(min=0) * 0x2545F491 + layer * 0x27D4EB2F + salt) % (1 << 31)
        h = (h ^ (h >> 13)) * 0x165667B1 % (1 << 31)
        out.append((h ^ (h >> 16)).to(torch.float32) / float(1 << 31))
    return out[0], out[1]


def chunk_importance_scores(
    probs: torch.Tensor, visible: torch.Tensor, values: torch.Tensor, n_chunks: int, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's chunk scores (SPEC §1.2) from window probabilities: score_k, score_v (B, C)."""
    weights = per_token_attention(probs, visible)
    metric_k, metric_v = token_metrics(weights, values)
    n = n_chunks * chunk_size
    return chunk_scores(metric_k[:, :n], chunk_size), chunk_scores(metric_v[:, :n], chunk_size)

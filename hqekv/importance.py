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
    probs = q.new_empty(b, hkv, hq // hkv, m, keys.shape[2])
    for h in range(hkv):  # one KV head at a time: the temporaries are a head's, not the layer's
        logits = torch.einsum("bgmd,bnd->bgmn", q[:, h], keys[:, h].float()) * scaling
        logits = logits.masked_fill(~visible[:, None], -float("inf"))
        probs[:, h] = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return probs, visible


def window_attention(
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
    per-token attention (:func:`window_attention`)."""
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

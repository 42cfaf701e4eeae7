"""Per-head RMSNorm on queries and keys before RoPE: Qwen3, Qwen3-MoE, Gemma3 and Apertus.

Gemma3's other differences live elsewhere: its ``query_pre_attn_scalar`` scaling is the
module's ``scaling``, which the shared forward passes on; its local layers are
sliding-window layers (:mod:`hqekv.cache.sliding`).
"""

from __future__ import annotations

import torch

from .base import split_heads


def projector(apply_rotary_pos_emb):
    """``project(module, hidden, (cos, sin))`` -> normed q, k with RoPE, and v, as (B, H, S, D)."""

    def project(module, hidden_states: torch.Tensor, position_embeddings):
        query, key, value = split_heads(
            module, hidden_states, module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)
        )
        query, key = module.q_norm(query), module.k_norm(key)  # over the head dim, as the models do
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        return query, key, value

    return project

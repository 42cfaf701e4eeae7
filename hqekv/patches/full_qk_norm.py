"""RMSNorm over the whole query and key projections (all heads together), before the split
into heads and RoPE: OLMo2 and OLMo3."""

from __future__ import annotations

import torch

from .base import split_heads


def projector(apply_rotary_pos_emb):
    """``project(module, hidden, (cos, sin))`` -> normed q, k with RoPE, and v, as (B, H, S, D)."""

    def project(module, hidden_states: torch.Tensor, position_embeddings):
        query, key, value = split_heads(
            module,
            hidden_states,
            module.q_norm(module.q_proj(hidden_states)),
            module.k_norm(module.k_proj(hidden_states)),
            module.v_proj(hidden_states),
        )
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        return query, key, value

    return project

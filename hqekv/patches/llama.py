"""Separate q/k/v projections, then RoPE: Llama (SmolLM2, Llama 2/3), Mistral, Mixtral and
Qwen2 (whose projections carry a bias, applied by the ``nn.Linear`` itself)."""

from __future__ import annotations

import torch

from .base import split_heads


def projector(apply_rotary_pos_emb):
    """``project(module, hidden, (cos, sin))`` -> q (B, Hq, S, D), k, v (B, Hkv, S, D), RoPE applied."""

    def project(module, hidden_states: torch.Tensor, position_embeddings):
        query, key, value = split_heads(
            module, hidden_states, module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)
        )
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        return query, key, value

    return project

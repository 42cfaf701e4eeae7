"""Phi3: one fused ``qkv_proj``, split into queries, keys and values; partial RoPE is the
model's own ``apply_rotary_pos_emb``."""

from __future__ import annotations

import torch

from .base import split_heads


def projector(apply_rotary_pos_emb):
    """``project(module, hidden, (cos, sin))`` -> q (B, Hq, S, D), k, v (B, Hkv, S, D), RoPE applied."""

    def project(module, hidden_states: torch.Tensor, position_embeddings):
        q_size = module.config.num_attention_heads * module.head_dim
        kv_size = module.num_key_value_heads * module.head_dim
        query, key, value = split_heads(
            module, hidden_states, *module.qkv_proj(hidden_states).split([q_size, kv_size, kv_size], dim=-1)
        )
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        return query, key, value

    return project

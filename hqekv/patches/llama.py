"""Separate q/k/v projections, then RoPE: Llama (SmolLM2, Llama 2/3) and the families whose
attention computes the same (Mistral, Mixtral, Ministral, Qwen2, Qwen2-MoE, Granite,
StarCoder2, ...; a bias on the projections lives inside the ``nn.Linear``, Granite's
attention multiplier is the module's ``scaling``). A layer that has no positional encoding
(SmolLM3's NoPE layers: ``module.use_rope`` false) skips RoPE, as the model does."""

from __future__ import annotations

import torch

from .base import split_heads


def projector(apply_rotary_pos_emb):
    """``project(module, hidden, (cos, sin))`` -> q (B, Hq, S, D), k, v (B, Hkv, S, D), RoPE applied."""

    def project(module, hidden_states: torch.Tensor, position_embeddings):
        query, key, value = split_heads(
            module, hidden_states, module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)
        )
        if getattr(module, "use_rope", True):
            cos, sin = position_embeddings
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
        return query, key, value

    return project

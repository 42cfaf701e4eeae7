"""Llama family (SmolLM2, Llama 2/3): q/k/v projections and RoPE, as in ``LlamaAttention``."""

from __future__ import annotations

import torch
from transformers.models.llama import modeling_llama

from .base import make_attention_forward


def project_llama(module, hidden_states: torch.Tensor, position_embeddings):
    """hidden (B, S, hidden) -> q (B, Hq, S, D), k, v (B, Hkv, S, D), RoPE applied."""
    hidden_shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    query = module.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key = module.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = modeling_llama.apply_rotary_pos_emb(query, key, cos, sin)
    return query, key, value


ATTENTION_CLASSES = (modeling_llama.LlamaAttention,)
forward = make_attention_forward(project_llama, modeling_llama.eager_attention_forward)

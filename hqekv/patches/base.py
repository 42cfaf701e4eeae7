"""The attention forward shared by every patched architecture.

An architecture file only says how a module turns hidden states into (q, k, v) after
RoPE; this forward then attends through the request's :class:`~hqekv.cache.HqeKVCache`.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..cache import HqeKVCache

Projector = Callable[[torch.nn.Module, torch.Tensor, tuple[torch.Tensor, torch.Tensor]], tuple]


def make_attention_forward(project: Projector, eager_fallback: Callable):
    """Build ``forward(self, hidden_states, position_embeddings, attention_mask, cache, **kw)``.

    ``project(module, hidden_states, position_embeddings) -> q (B, Hq, S, D), k, v (B, Hkv, S, D)``.
    """

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        past_key_values=None,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        if cache is None:
            # No cache requested (use_cache=False): nothing to compress, the original forward is exact.
            return type(self).forward(
                self, hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs
            )
        if not isinstance(cache, HqeKVCache):
            raise TypeError(
                f"this model is patched by hqekv but got a {type(cache).__name__}; pass no cache (one is created) "
                "or an hqekv.HqeKVCache, or call hqekv.unpatch_model(model) first"
            )
        input_shape = hidden_states.shape[:-1]
        query, key, value = project(self, hidden_states, position_embeddings)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_fallback)

        def dense_attention(q, k, v):
            out, _ = interface(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
            return out

        layer = cache.layers[self.layer_idx]
        out = layer.attend(query, key, value, self.scaling, cache.input_valid, dense_attention)
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), None

    return forward

"""The attention forward shared by every patched architecture.

An architecture file only says how a module turns hidden states into (q, k, v) after
RoPE; this forward then attends through the request's :class:`~hqekv.cache.HqeKVCache`
layer for that module: an :class:`~hqekv.cache.HqeKVLayer` for a global attention layer,
a :class:`~hqekv.cache.SlidingWindowLayer` for a sliding-window one.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..cache import HqeKVCache

PADDING_MASK = "hqekv_new_valid"
"""The keyword under which the patched decoder hands every attention layer the padding mask
of the forward's new tokens, (B, S) bool, False for padding: transformers passes a decoder's
extra keyword arguments down to its attention modules, and the patched attention takes it
out before anything else sees it."""

Projector = Callable[[torch.nn.Module, torch.Tensor, tuple[torch.Tensor, torch.Tensor]], tuple]


def sliding_windows(text_config) -> list[int | None]:
    """Per layer, the sliding window W of a sliding-attention layer, or None for a global one.

    As the models choose their masks: with ``layer_types`` (Qwen2, Qwen3, Gemma3) a
    ``"sliding_attention"`` layer slides over ``sliding_window``; without (Mistral, Mixtral,
    Phi3, Qwen3-MoE, StarCoder2) every layer slides when ``sliding_window`` is set; a config
    with ``use_sliding_window=False`` (Qwen2, SmolLM3) slides nowhere.
    """
    n = text_config.num_hidden_layers
    window = getattr(text_config, "sliding_window", None)
    if getattr(text_config, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        return [window] * n
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"hqekv supports full and sliding attention layers, not {unknown}")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def split_heads(module, hidden_states: torch.Tensor, *projections: torch.Tensor) -> list[torch.Tensor]:
    """(B, S, H·D) projections -> (B, H, S, D) each."""
    shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    return [p.view(shape).transpose(1, 2) for p in projections]


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
        new_valid = kwargs.pop(PADDING_MASK, None)
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
        layer = cache.layers[self.layer_idx]
        window = getattr(layer, "window", None)

        def dense_attention(q, k, v):
            out, _ = interface(
                self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, sliding_window=window, **kwargs
            )
            return out

        out = layer.attend(query, key, value, self.scaling, new_valid, dense_attention)
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), None

    return forward

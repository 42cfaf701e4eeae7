"""Tiny randomly-initialised models of every supported family, built from their config classes.

Shapes are small but keep what makes each family different: QKV bias (Qwen2), q/k norms
(Qwen3, Qwen3-MoE, Gemma3), a fused qkv projection and partial RoPE (Phi3), experts
(Mixtral, Qwen3-MoE), and sliding windows shorter than the test prompts (Mistral, Gemma3
with one global layer among sliding ones, like the real model's 5:1 pattern).
"""

from __future__ import annotations

import torch

SLIDING_WINDOW = 48
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _configs():
    import transformers as T

    return {
        "llama": lambda: T.LlamaConfig(num_hidden_layers=2, **COMMON),
        "mistral": lambda: T.MistralConfig(num_hidden_layers=2, sliding_window=SLIDING_WINDOW, **COMMON),
        "mixtral": lambda: T.MixtralConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, **COMMON),
        "qwen2": lambda: T.Qwen2Config(num_hidden_layers=2, **COMMON),
        "qwen3": lambda: T.Qwen3Config(num_hidden_layers=2, **COMMON),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(
            num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **COMMON
        ),
        "gemma3_text": lambda: T.Gemma3TextConfig(
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=SLIDING_WINDOW,
            query_pre_attn_scalar=24,
            **{**COMMON, "num_key_value_heads": 1},
        ),
        "phi3": lambda: T.Phi3Config(num_hidden_layers=2, partial_rotary_factor=0.5, **COMMON),
    }


FAMILIES = tuple(_configs())


def tiny_model(family: str, seed: int = 0, dtype=torch.float32):
    """A small random causal LM of ``family`` (a ``model_type``), eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _configs()[family]()
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return model

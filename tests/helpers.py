"""What the tests share: tiny models (a Llama, and one of every supported family), prompts,
greedy and compiled generation, a decode loop, call counters, the bytes a cache holds
counted independently of its memory report, artifact metadata and a tiny calibration
objective. Test files import from here, never from each other.

The tiny family models are built from their config classes. Shapes are small but keep
what makes each family different: QKV bias (Qwen2), q/k norms (Qwen3, Qwen3-MoE, Gemma3), a
fused qkv projection and partial RoPE (Phi3), experts (Mixtral, Qwen3-MoE), and sliding
windows shorter than the test prompts (Mistral, Gemma3 with one global layer among sliding
ones, like the real model's 5:1 pattern).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import LogitsProcessor

from hqekv.config import TierRatios

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


EVERY_TIER = TierRatios(int4=0.3, int2=0.4, int1=0.2, evict=0.1)
"""Shares that use every tier, eviction too."""

MIXED = TierRatios(int4=0.3, int2=0.3, int1=0.2, evict=0.2)
"""Every quantized tier and a fifth of the chunks evicted: eviction in every short test."""


def tiny_llama(seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


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
        "ministral": lambda: T.MinistralConfig(
            num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=SLIDING_WINDOW, **COMMON
        ),
        "qwen2_moe": lambda: T.Qwen2MoeConfig(
            num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, **COMMON,
        ),  # fmt: skip
        "granite": lambda: T.GraniteConfig(
            num_hidden_layers=2, attention_multiplier=0.2, embedding_multiplier=2.0, residual_multiplier=0.5,
            logits_scaling=4.0, **COMMON,
        ),  # fmt: skip
        "granitemoe": lambda: T.GraniteMoeConfig(
            num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, attention_multiplier=0.2, **COMMON
        ),
        "starcoder2": lambda: T.Starcoder2Config(num_hidden_layers=2, sliding_window=None, **COMMON),
        "helium": lambda: T.HeliumConfig(num_hidden_layers=2, **COMMON),
        "arcee": lambda: T.ArceeConfig(num_hidden_layers=2, **COMMON),
        "seed_oss": lambda: T.SeedOssConfig(num_hidden_layers=2, **COMMON),
        "ernie4_5": lambda: T.Ernie4_5Config(num_hidden_layers=2, **COMMON),
        "glm": lambda: T.GlmConfig(num_hidden_layers=2, partial_rotary_factor=0.5, **COMMON),
        "smollm3": lambda: T.SmolLM3Config(num_hidden_layers=2, no_rope_layer_interval=2, **COMMON),  # layer 1: NoPE
        "apertus": lambda: T.ApertusConfig(num_hidden_layers=2, **COMMON),
        "olmo2": lambda: T.Olmo2Config(num_hidden_layers=2, **COMMON),
        "olmo3": lambda: T.Olmo3Config(
            num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=SLIDING_WINDOW, **COMMON
        ),
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


def sharpen_attention(model, factor: float = 20.0) -> None:
    """Make ``model``'s attention depend on positions and content.

    At random initialisation queries and keys are so small that every token attends almost
    evenly, so that RoPE, the scaling or a norm could be wrong without changing an output.
    Scales the query and key projections by ``factor``; where queries and keys are normed
    (which would undo that), sets the norms' weights to 3 instead.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.fill_(3.0)
            elif name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                param.mul_(factor)


def prompt(n: int, seed: int = 0, batch: int = 1, low: int = 1) -> torch.Tensor:
    """(batch, n) random token ids in [low, 128), seeded."""
    return torch.randint(low, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, n: int, **kw):
    """Greedy ``generate`` of exactly ``n`` new tokens after ``ids`` (None: the ids are in ``kw``)."""
    with torch.no_grad():
        if ids is None:
            return model.generate(max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


def assert_left_padding_matches_single_rows(model, n: int, low: int = 1) -> None:
    """Two prompts of 150 and 97 tokens (ids from ``low``), the shorter left-padded with 0,
    give ``model`` the same ``n`` greedy tokens batched as each alone."""
    a, b = prompt(150, seed=1, low=low)[0], prompt(97, seed=2, low=low)[0]
    singles = [greedy(model, x[None], n)[0, x.numel() :] for x in (a, b)]
    pad = a.numel() - b.numel()
    ids = torch.stack([a, torch.cat([torch.zeros(pad, dtype=torch.long), b])])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    batched = greedy(model, ids, n, attention_mask=mask, pad_token_id=0)[:, ids.shape[1] :]
    assert torch.equal(batched[0], singles[0])
    assert torch.equal(batched[1], singles[1])


class CompileCounts(LogitsProcessor):
    """A logits processor recording, at each generated token, how many frames the counter has
    compiled so far."""

    def __init__(self, counter):
        self.counter = counter
        self.per_step: list[int] = []

    def __call__(self, input_ids, scores):
        self.per_step.append(self.counter.frame_count)
        return scores


def compiled_generate(model, inputs: dict, new_tokens: int, backend: str):
    """Greedy generate with ``model.forward`` compiled; -> (tokens, frames compiled at each step)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from transformers import LogitsProcessorList

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    counts = CompileCounts(counter)
    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, backend=counter)
    try:
        with torch.no_grad():
            out = model.generate(
                **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                logits_processor=LogitsProcessorList([counts]),
            )  # fmt: skip
    finally:
        model.forward = eager_forward
    return out, counts.per_step


def decode_loop(model, cache, tokens: torch.Tensor, step=None) -> list[torch.Tensor]:
    """Feed ``tokens`` (B, N) one column at a time, the eager step before each; -> logits per step."""
    step = model if step is None else step
    logits = []
    for i in range(tokens.shape[1]):
        cache.maintain()  # the eager step between decode steps (generate runs it itself)
        with torch.no_grad():
            out = step(input_ids=tokens[:, i : i + 1], attention_mask=torch.ones_like(tokens[:, :1]), cache=cache)
        logits.append(out.logits[:, -1])
    return logits


class Calls:
    """Counts calls of one method on one object (eager code only)."""

    def __init__(self, monkeypatch, obj, name: str):
        self.count = 0
        method = getattr(obj, name)

        def counted(*args, **kwargs):
            self.count += 1
            return method(*args, **kwargs)

        monkeypatch.setattr(obj, name, counted)


def stored_bytes(cache) -> int:
    """Bytes of every tensor an HqeKV cache holds, found independently of memory_report."""
    total = 0
    for layer in cache.layers:
        for name, value in vars(layer).items():
            if name == "rotation":
                continue  # one constant matrix shared by every layer and cache, like a model buffer
            if isinstance(value, torch.Tensor):
                total += value.nbytes
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):  # a part: its own tensors
                total += sum(t.nbytes for t in vars(value).values() if isinstance(t, torch.Tensor))
            elif isinstance(value, dict):
                total += sum(t.nbytes for pool in value.values() for t in pool.tensors())
    return total


def metadata(model, bavg=2.0, **overrides):
    """Valid artifact metadata for ``model`` (a tiny Llama), with ``overrides``."""
    import hqekv
    from hqekv.artifacts import model_fingerprint

    meta = {
        "model_id": "tiny/llama",
        "model_type": "llama",
        "config_fingerprint": model_fingerprint(model),
        "bavg": bavg,
        "chunk_size": 32,
        "window": 20,
        "rerank_interval": 32,
        "protected_chunks": 2,
        "eviction": "joint",
        "value_group": 64,
        "rotation": "hadamard",
        "alpha": 2.0,
        "beta": 4.0,
        "trials": 200,
        "best_loss": 0.5,
        "calibration_data": "test",
        "calibration_data_sha256": "0" * 64,
        "library_version": hqekv.__version__,
    }
    meta.update(overrides)
    return meta


class CharTokenizer:
    """Characters to ids below the tiny model's vocabulary of 128."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 127 + 1 for c in text]}


def tiny_objective(layers: int):
    """(model, context, continuation, objective) on a tiny random Llama of ``layers`` layers."""
    from hqekv.calibration import CompressionObjective

    model = tiny_llama(seed=3, layers=layers)
    g = torch.Generator().manual_seed(0)
    context = torch.randint(1, 128, (1, 300), generator=g)
    continuation = torch.randint(1, 128, (1, 40), generator=g)
    return model, context, continuation, CompressionObjective(model, context, continuation)


def chunk_bytes_of(layer) -> torch.Tensor:
    """Bytes each row's chunks hold (codes, metadata, FP16 chunks), from its tables (B,)."""
    from hqekv import allocation
    from hqekv.cache.pools import KEY
    from hqekv.tiers import INT4

    g, h, d = layer.config.chunk_size, layer.num_kv_heads, layer.head_dim
    pools = layer.pools
    bytes_k, bytes_v = allocation.chunk_bytes(
        h, g, d, layer.value_group, pools[KEY].fp.element_size(), pools[KEY].quantized[INT4].meta0.element_size()
    )
    table = layer.live_table()
    kept = table.chunk_pos >= 0
    return torch.where(kept, bytes_k[table.k_tier.clamp(0, 3)] + bytes_v[table.v_tier.clamp(0, 3)], 0.0).sum(1)

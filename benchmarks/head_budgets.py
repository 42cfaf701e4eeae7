"""Would tiers per KV head beat tiers per chunk? The allocator's own objective, per layer.

    python benchmarks/head_budgets.py [--model smollm2] [--context 2048] [--bavg 1 2 3] [--out NAME]

A chunk's tier holds for all its KV heads by default (``head_tiers=True`` builds tiers per
head; docs/results.md, "Tiers per KV head", measures them on held-out text). Per layer of a prefill of the calibration
text (never read by the evaluation), this takes the window probabilities the cache's
re-rank would take (the last ``m`` queries), measures every choice's distortion
(:func:`hqekv.allocation.distortions`) and lets :func:`hqekv.allocation.allocate` spend the
same bytes twice: over chunks (every head of a chunk at one tier, as the cache does) and over
(chunk, KV head) pairs (each head's part of a chunk at its own tier, priced at its own real
bytes). It prints and saves the distortion each reaches, summed over layers: the most that
per-head tiers could gain in this objective, before any cost in tables or kernels.
"""

import argparse

import torch
from common import save

import hqekv
from hqekv import allocation
from hqekv.cache import HqeKVLayer
from hqekv.texts import calibration_text
from hqekv.importance import window_probabilities
from hqekv.packaged_models import load_model
from hqekv.tiers import EVICTED


def captured_layers(model, ids):
    """Each layer's (queries, keys, values) after RoPE, as the patched model stores a prompt."""
    seen = {}
    original = HqeKVLayer._store

    def spy(self, query, key, value, new_valid):
        seen[self.layer_idx] = (query.detach().clone(), key.detach().clone(), value.detach().clone())
        return original(self, query, key, value, new_valid)

    HqeKVLayer._store = spy
    try:
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1)
    finally:
        HqeKVLayer._store = original
    return [seen[i] for i in sorted(seen)]


def spent(d_k, d_v, d_e, k_tier, v_tier):
    """The distortion of the choices made: eviction's where evicted, else keys' plus values'."""
    evicted = k_tier == EVICTED
    tk, tv = k_tier.clamp(0, 3), v_tier.clamp(0, 3)
    kept = d_k.gather(-1, tk[..., None])[..., 0] + d_v.gather(-1, tv[..., None])[..., 0]
    return float(torch.where(evicted, d_e, kept).sum())


def layer_comparison(query, key, value, config, bavg, value_group, scaling):
    _, hkv, n, d = key.shape
    g, m = config.chunk_size, config.window
    c = n // g
    pos = torch.arange(n)[None]
    probs, _ = window_probabilities(
        query[:, :, -m:], pos[:, -m:], torch.ones(1, m, dtype=torch.bool), key, pos, torch.ones(1, n, dtype=torch.bool),
        scaling,
    )  # fmt: skip
    meta = torch.float16
    rows = {}
    # per chunk: every KV head at the chunk's tier
    d_k, d_v, d_e, _ = allocation.distortions(probs, query[:, :, -m:], key, value, c, g, scaling, value_group, meta)
    bytes_k, bytes_v = allocation.chunk_bytes(hkv, g, d, value_group, 2, 2)
    budget = torch.tensor([c * bavg / 8 * 2 * hkv * g * d], dtype=torch.float64)
    start = torch.zeros(1, c, dtype=torch.long)
    evictable = torch.ones(1, c, dtype=torch.bool)
    evictable[:, 0] = False  # the first chunk (attention sink) stays, in both
    tk, tv = allocation.allocate(d_k, d_v, d_e, bytes_k, bytes_v, start, start, evictable, budget)
    rows["per_chunk"] = spent(d_k, d_v, d_e, tk, tv)
    # per (chunk, KV head): each head's part of a chunk at its own tier, within the same bytes
    parts = []
    gq = query.shape[1] // hkv
    for h in range(hkv):
        parts.append(allocation.distortions(
            probs[:, h : h + 1], query[:, h * gq : (h + 1) * gq, -m:], key[:, h : h + 1], value[:, h : h + 1], c, g,
            scaling, value_group, meta,
        )[:3])  # fmt: skip
    hk, hv, he = (torch.cat([p[i] for p in parts], 1) for i in range(3))  # (1, Hkv·C, ...)
    head_bytes_k, head_bytes_v = allocation.chunk_bytes(1, g, d, value_group, 2, 2)
    start_h = torch.zeros(1, hkv * c, dtype=torch.long)
    evictable_h = evictable.repeat(1, hkv)
    tk, tv = allocation.allocate(hk, hv, he, head_bytes_k, head_bytes_v, start_h, start_h, evictable_h, budget)
    rows["per_head"] = spent(hk, hv, he, tk, tv)
    rows["heads_split"] = float(((tk.view(hkv, c) != tk.view(hkv, c)[:1]).any(0)).float().mean())
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--bavg", type=float, nargs="+", default=[1.0, 2.0, 3.0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, model_id = load_model(args.model)
    ids = calibration_text(tok, args.context, 1).context
    hqekv.patch_model(model, 2.0, ratios="auto")
    layers = captured_layers(model, ids)
    config = hqekv.new_cache(model).layers[0].config
    value_group = min(config.value_group, layers[0][1].shape[-1])
    scaling = layers[0][0].shape[-1] ** -0.5
    results = []
    for bavg in args.bavg:
        total = {"per_chunk": 0.0, "per_head": 0.0}
        split = []
        for query, key, value in layers:
            rows = layer_comparison(query.float(), key.float(), value.float(), config, bavg, value_group, scaling)
            total["per_chunk"] += rows["per_chunk"]
            total["per_head"] += rows["per_head"]
            split.append(rows["heads_split"])
        gain = 1 - total["per_head"] / total["per_chunk"]
        results.append({"bavg": bavg, **total, "per_head_vs_per_chunk": total["per_head"] / total["per_chunk"],
                        "chunks_whose_heads_split": sum(split) / len(split)})  # fmt: skip
        print(f"bavg {bavg}: distortion per chunk {total['per_chunk']:.4g}, per head {total['per_head']:.4g} "
              f"({gain:+.1%} less); chunks whose heads take different key tiers {sum(split) / len(split):.0%}")
    save("head_budgets", {"model": model_id, "context": args.context, "text": "calibration articles",
                          "objective": "allocation.distortions (retrieval), summed over layers", "rows": results},
         args.out)  # fmt: skip


if __name__ == "__main__":
    main()

"""Real bytes of every part of an HqeKV cache, per element, at 2K-32K tokens, fp32 and bf16.

    python benchmarks/memory.py [--model smollm2|qwen2.5-coder|gemma3] [--lengths 2048 ...] [--bavg 2 3.2]

The model's shapes (SmolLM2-135M by default: 30 layers, 9 query / 3 KV heads, head dim 64;
Gemma3's sliding layers as exact windows) with the ratios ``patch_model`` resolves for it
(the shipped artifacts), fed random keys, values and queries: bytes depend on the tier counts, not on the values. Each row is one prefill of
``tokens`` tokens followed by 32 decode steps (a flush and a re-rank), as ``generate``
leaves the cache; figures are bits per K/V element of the real tokens, everything counted.
The targets (effective bits <= bavg + 1.25 at 4K tokens, <= bavg + 1.0 from 16K) are
checked and recorded.
"""

import argparse
import warnings

from common import save

import torch

import hqekv
from hqekv.cache import HqeKVCache
from hqekv.packaged_models import MODEL_NAMES, SMOLLM2, load_model
from hqekv.patches import sliding_windows
from hqekv.patching import resolve_config

DECODE_STEPS = 32


def target(tokens: int) -> float | None:
    """Allowed effective bits above bavg at this length (None: no target)."""
    if tokens >= 16384:
        return 1.0
    if tokens >= 4096:
        return 1.25
    return None


def fill(config, text_config, tokens: int, dtype: torch.dtype, seed: int = 0) -> HqeKVCache:
    """A cache after a prefill of ``tokens`` random tokens and ``DECODE_STEPS`` decode steps."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = text_config.num_attention_heads, text_config.num_key_value_heads
    d = getattr(text_config, "head_dim", None) or text_config.hidden_size // hq
    cache = HqeKVCache(config, text_config.num_hidden_layers, sliding_windows(text_config))
    skip = lambda q, k, v: q.new_zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3])  # noqa: E731 (bytes only)
    with torch.no_grad():
        for layer in cache.layers:
            q = torch.randn(1, hq, tokens, d, generator=gen).to(dtype)
            k = torch.randn(1, hkv, tokens, d, generator=gen).to(dtype)
            v = torch.randn(1, hkv, tokens, d, generator=gen).to(dtype)
            layer.attend(q, k, v, d**-0.5, dense_attention=skip)
        cache.advance(tokens)
        for _ in range(DECODE_STEPS):
            cache.maintain()
            for layer in cache.layers:
                q = torch.randn(1, hq, 1, d, generator=gen).to(dtype)
                k = torch.randn(1, hkv, 1, d, generator=gen).to(dtype)
                layer.attend(q, k, torch.randn(1, hkv, 1, d, generator=gen).to(dtype), d**-0.5)
            cache.advance(1)
    return cache


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--bavg", type=float, nargs="+", default=[2.0, 3.2])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--model", choices=MODEL_NAMES, default=SMOLLM2)
    args = parser.parse_args()
    model, _, model_id = load_model(args.model)
    text_config = model.config.get_text_config()
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for bavg in args.bavg:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", hqekv.UncalibratedRatiosWarning)
                config = resolve_config(model, bavg)
            for n in args.lengths:
                report = fill(config, text_config, n, dtype).memory_report()
                bits_by_part = {p: 8 * b / report.elements for p, b in report.bytes_by_part.items()}
                allowed = target(n)
                row = {
                    "dtype": dtype_name,
                    "tokens": n + DECODE_STEPS,
                    "bavg_target": bavg,
                    "ratios": config.ratios.describe(),
                    "ratios_source": config.ratios_source,
                    "bits_by_part": bits_by_part,
                    "effective_bits_limit": None if allowed is None else bavg + allowed,
                    "meets_target": None if allowed is None else report.effective_bits <= bavg + allowed,
                    **report.to_dict(),
                }
                rows.append(row)
                parts = " ".join(f"{p}={b:.3f}" for p, b in sorted(bits_by_part.items()) if b)
                verdict = "" if allowed is None else f" (limit {bavg + allowed:.2f}: {'ok' if row['meets_target'] else 'MISSED'})"
                print(f"{dtype_name:8s} bavg {bavg:>4} {n:6d} tokens: effective {report.effective_bits:.3f} bits, "
                      f"code bavg {report.bavg:.3f}{verdict}\n    {parts}", flush=True)  # fmt: skip
    levers = lever_rows(model, text_config, args.bavg)
    save("memory" if args.model == SMOLLM2 else f"memory-{args.model}", {
        "model": f"{model_id} shapes, random K/V, shipped ratios",
        "decode_steps": DECODE_STEPS,
        "all_targets_met": all(r["meets_target"] is not False for r in rows),
        "rows": rows,
        "levers": levers,
    })  # fmt: skip


LEVERS = [
    ("before: model-dtype full precision, value groups of 32", {"fp_dtype": "model", "value_group": 32}),
    ("+ 16-bit full precision", {"value_group": 32}),
    ("+ value groups of 64 (defaults)", {}),
]


def lever_rows(model, text_config, bavgs, tokens: int = 4096) -> list[dict]:
    """Effective bits at ``tokens`` of an fp32 model as each byte lever is switched on, same ratios."""
    import dataclasses

    rows = []
    for bavg in bavgs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", hqekv.UncalibratedRatiosWarning)
            base = resolve_config(model, bavg)
        for name, settings in LEVERS:
            config = dataclasses.replace(base, **{"fp_dtype": None, "value_group": 64, **settings})
            report = fill(config, text_config, tokens, torch.float32).memory_report()
            rows.append({"bavg_target": bavg, "tokens": tokens + DECODE_STEPS, "dtype": "float32", "lever": name,
                         "effective_bits": report.effective_bits, "ratios": base.ratios.describe()})  # fmt: skip
            print(f"levers fp32 bavg {bavg:>4} {tokens} tokens: {report.effective_bits:.3f} bits  {name}", flush=True)
    return rows


if __name__ == "__main__":
    main()

"""Soak: a long decode and many requests on one patched model, bytes and memory checked.

    python benchmarks/soak.py [--decode 8192] [--bavg 2] [--calls 20]

1. SmolLM2 at ``--bavg`` decodes ``--decode`` tokens after a 512-token prompt through
   ``model.generate``; at every re-rank the cache's code bits must stay within what the
   ratios promise: bavg per element, plus the FP16 parts the policy keeps on top of the
   ratios (per layer up to 2·protected chunks and the tail of up to G tokens, at 16 bits).
2. ``--calls`` generate calls (2K-token prompt, 64 new tokens) on the same model: the
   process RSS after the last call must be within 5% of the RSS after the second (the
   first call warms allocators and caches).

Prints and saves ``benchmarks/results/soak.json``.
"""

import argparse
import time

from common import essay_ids, load_smollm2, save

import torch

import hqekv
from hqekv.cache import HqeKVLayer


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def promised_bits(report, config, layers: int) -> float:
    """Code bits the ratios allow: bavg per element plus the FP16 chunks and tail kept on top."""
    per_token = report.elements / max(1, report.chunks.get("real_tokens", 0))  # K and V elements of all layers
    per_layer_token = per_token / layers
    extra_tokens = 2 * config.protected_chunks * config.chunk_size + config.chunk_size
    return report.elements * config.bavg + layers * extra_tokens * per_layer_token * 16


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--decode", type=int, default=8192)
    parser.add_argument("--bavg", type=float, default=2.0)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    hqekv.patch_model(model, bavg=args.bavg)
    config = hqekv.patch_config(model)
    layers = model.config.num_hidden_layers

    checks, cache = [], hqekv.new_cache(model)
    first = cache.layers[0]
    original = HqeKVLayer.rerank

    def watched(self, rows):
        original(self, rows)
        if self is first:
            report = cache.memory_report()
            allowed = promised_bits(report, config, layers)
            checks.append({"tokens": report.chunks["real_tokens"], "code_bits": report.code_bits,
                           "allowed_bits": allowed, "bavg": report.bavg, "effective_bits": report.effective_bits,
                           "ok": report.code_bits <= allowed})  # fmt: skip

    HqeKVLayer.rerank = watched
    start = time.perf_counter()
    try:
        with torch.no_grad():
            model.generate(essay_ids(tokenizer, 512), cache=cache, max_new_tokens=args.decode,
                           min_new_tokens=args.decode, do_sample=False)  # fmt: skip
    finally:
        HqeKVLayer.rerank = original
    decode_s = time.perf_counter() - start
    bad = [c for c in checks if not c["ok"]]
    last = checks[-1]
    print(f"decode {args.decode} tokens in {decode_s:.0f} s: {len(checks)} re-ranks, {len(bad)} over the promise; "
          f"final bavg {last['bavg']:.3f}, effective {last['effective_bits']:.3f} bits", flush=True)  # fmt: skip

    rss = []
    ids = essay_ids(tokenizer, 2048)
    for i in range(args.calls):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=64, do_sample=False)
        rss.append(rss_mib())
        print(f"call {i + 1}: RSS {rss[-1]:.0f} MiB", flush=True)
    growth = (rss[-1] - rss[1]) / rss[1] if len(rss) > 1 else 0.0
    print(f"RSS growth from call 2 to {args.calls}: {growth:+.1%}")
    save("soak", {
        "model": "SmolLM2-135M-Instruct", "bavg": args.bavg, "ratios": config.describe_ratios(),
        "decode_tokens": args.decode, "decode_seconds": decode_s, "reranks": checks,
        "all_reranks_within_promise": not bad, "rss_mib": rss, "rss_growth": growth, "rss_flat": abs(growth) <= 0.05,
    })  # fmt: skip


if __name__ == "__main__":
    main()

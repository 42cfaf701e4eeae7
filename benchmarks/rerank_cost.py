"""What a re-rank's choices cost per layer, on SmolLM2: the importance scores (fixed ratios)
and the allocator's choices (``ratios="auto"``), on the cache of a one-shot prefill.

    python benchmarks/rerank_cost.py [--lengths 4096] [--threads 1] [--repeats 3] [--out PATH]

For each length, the essays' first tokens are prefilled through a patched model (bavg 2,
the shipped ratios; then ``ratios="auto"``), and every layer's
:func:`hqekv.cache.rerank.chunk_scores` (shipped ratios) or
:func:`hqekv.cache.rerank.allocator_choices` (allocator) is timed; neither changes the
cache, so each pass over the layers reads the same one. Figures: milliseconds per layer,
the best of ``--repeats`` passes. This times the part of a re-rank that reads the whole
cache (the window's attention over it, the importance, the allocator's distortions), not
the pools' rebuild; ``benchmarks/decode.py`` times whole re-ranks inside ``generate``.
"""

import argparse
import time

import torch
from common import essay_ids, load_smollm2, save

import hqekv
from hqekv.cache import rerank
from hqekv.patching import output_cache

CHOICES = {"bavg 2 (shipped ratios): chunk_scores": ({}, rerank.chunk_scores),
           "auto:2 (allocator): allocator_choices": ({"ratios": "auto"}, rerank.allocator_choices)}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="JSON path (default benchmarks/results/rerank_cost.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    rows = []
    for length in args.lengths:
        ids = essay_ids(tokenizer, length)
        for name, (settings, choose) in CHOICES.items():
            hqekv.patch_model(model, 2.0, **settings)
            try:
                with torch.no_grad():
                    cache = output_cache(model(ids, use_cache=True))
                    best = float("inf")
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        for layer in cache.layers:
                            choose(layer)
                        best = min(best, (time.perf_counter() - start) / len(cache.layers))
            finally:
                hqekv.unpatch_model(model)
            rows.append({"tokens": length, "choice": name, "ms_per_layer": best * 1e3})
            print(f"{length:6d} tokens  {name:40s} {best * 1e3:7.2f} ms per layer", flush=True)
    save("rerank_cost", {"model": "SmolLM2-135M-Instruct (fp32)", "rows": rows}, args.out)


if __name__ == "__main__":
    main()

"""Chunked-prefill tokens/s of hqekv against the DynamicCache through ``model.generate``, same process, on SmolLM2.

    python benchmarks/prefill.py [--lengths 4096 7936] [--chunk 512] [--settings 2 2:wait-4bit 2:auto]
                                 [--dtype float32] [--repeats 2] [--out NAME]

Each run is one greedy ``generate`` of one new token after a prompt of the given length fed
in pieces of ``--chunk`` tokens (``prefill_chunk_size``; 0: the whole prompt at once), so
that its seconds are the prefill's: every piece attending over the cache and, for hqekv,
each piece's re-ranks and the settle at the end of the prompt. A pass runs the unpatched
model (``dynamic_cache``, the baseline of every ratio) and each setting one after the
other, so that what else runs on the machine weighs on all of them alike; each figure is
the best of ``--repeats`` passes. A setting is ``B[:auto][:RULE]`` as in
``benchmarks/peak_memory.py``: the budget, the allocator (``ratios="auto"``) and a
``chunked_prefill`` rule other than the default "wait" (``wait-4bit``, ``evict``).
Attention: the DynamicCache runs the model's SDPA; hqekv the model's SDPA for the first
piece and its own tiled attention over the compressed cache for the others.
"""

import argparse
import time

import torch
from common import essay_ids, load_smollm2, patch_arguments, save

import hqekv


def prefill_seconds(model, ids: torch.Tensor, chunk: int) -> float:
    """Seconds of one greedy ``generate`` of one token after ``ids`` (1, T), fed ``chunk`` tokens at a time."""
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                       prefill_chunk_size=chunk or None, disable_compile=True)  # fmt: skip
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 7936])
    parser.add_argument("--chunk", type=int, default=512, help="prefill_chunk_size; 0: the prompt at once")
    parser.add_argument("--settings", nargs="+", default=["2", "2:wait-4bit", "2:auto"],
                        help="hqekv settings B[:auto][:RULE] (default: %(default)s)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=2, help="passes over every setting, the best kept")
    parser.add_argument("--out", help="results name (default: prefill, or prefill-<dtype>)")
    args = parser.parse_args()
    patches = {s: patch_arguments(s) for s in args.settings}  # a typo fails before anything runs
    model, tok = load_smollm2()
    model = model.to(getattr(torch, args.dtype))
    prefill_seconds(model, essay_ids(tok, 1024), args.chunk and min(args.chunk, 512))  # warm-up
    best = {}
    for n in args.lengths:
        ids = essay_ids(tok, n)
        for _ in range(args.repeats):
            for setting in ["dynamic", *args.settings]:
                if setting != "dynamic":
                    hqekv.patch_model(model, **patches[setting])
                try:
                    s = prefill_seconds(model, ids, args.chunk)
                finally:
                    if setting != "dynamic":
                        hqekv.unpatch_model(model)
                best[setting, n] = min(s, best.get((setting, n), float("inf")))
                print(f"  {setting} {n}: {s:.1f} s", flush=True)
    rows = []
    for n in args.lengths:
        base = n / best["dynamic", n]
        row = {"tokens": n, "chunk": args.chunk, "dynamic_cache": {"prefill_tokens_per_s": base}, "hqekv": {}}
        for setting in args.settings:
            tps = n / best[setting, n]
            row["hqekv"][setting] = {"prefill_tokens_per_s": tps, "ratio": tps / base}
        rows.append(row)
        print(f"{n:6d} tokens, pieces of {args.chunk}: DynamicCache {base:.1f} tok/s; "
              + "; ".join(f"{s} {v['prefill_tokens_per_s']:.1f} ({v['ratio']:.2f}x)" for s, v in row["hqekv"].items()),
              flush=True)  # fmt: skip
    save(args.out or (f"prefill-{args.dtype}" if args.dtype != "float32" else "prefill"), {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1)", "device": "cpu", "dtype": args.dtype,
        "measured_through": "model.generate (greedy, one new token), prefill_chunk_size",
        "attention": "DynamicCache: the model's SDPA; hqekv: the model's SDPA for the first piece, its tiled "
                     "mixed_attention over the compressed cache for the others",
        "repeats": args.repeats, "figure": f"best prefill tokens/s of {args.repeats} passes over every setting",
        "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()

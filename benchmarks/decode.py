"""Prefill time and decode tokens/s of HqeKV vs the FP16 DynamicCache, same process, on SmolLM2.

    python benchmarks/decode.py [--lengths 2048 4096] [--new-tokens 64] [--bavg 3.2]

Decode is timed over ``--new-tokens`` greedy steps after the prefill (re-ranking every 32
tokens included); the ratio is HqeKV tokens/s over DynamicCache tokens/s.
"""

import argparse
import warnings

from common import essay_ids, load_smollm2, save

import hqekv
from hqekv.eval.tasks import greedy_generate


def run(model, ids, new_tokens):
    """Prefill seconds and decode tokens/s of ``new_tokens`` greedy steps after the prefill."""
    generated, prefill_s, decode_s, _ = greedy_generate(model, ids, new_tokens + 1)
    return prefill_s, new_tokens / decode_s, generated[1:]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bavg", type=float, default=3.2)
    args = parser.parse_args()
    model, tok = load_smollm2()
    rows = []
    run(model, essay_ids(tok, 256), 4)  # warm-up
    for n in args.lengths:
        ids = essay_ids(tok, n)
        base_prefill, base_tps, base_tokens = run(model, ids, args.new_tokens)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", hqekv.UncalibratedRatiosWarning)
            hqekv.patch_model(model, bavg=args.bavg)
        prefill, tps, tokens = run(model, ids, args.new_tokens)
        hqekv.unpatch_model(model)
        row = {
            "tokens": n,
            "new_tokens": args.new_tokens,
            "bavg": args.bavg,
            "dynamic_cache": {"prefill_s": base_prefill, "decode_tokens_per_s": base_tps},
            "hqekv": {"prefill_s": prefill, "decode_tokens_per_s": tps},
            "prefill_ratio": base_prefill / prefill,
            "decode_ratio": tps / base_tps,
            "same_tokens_fraction": float((tokens == base_tokens).float().mean()),
        }
        rows.append(row)
        print(
            f"{n:5d} tokens: prefill {prefill:.2f}s vs {base_prefill:.2f}s ({row['prefill_ratio']:.2f}x speed); "
            f"decode {tps:.1f} vs {base_tps:.1f} tok/s ({row['decode_ratio']:.2f}x)"
        )
    save("decode", {"model": "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1)", "device": "cpu",
                    "path": "pytorch reference", "rows": rows})


if __name__ == "__main__":
    main()

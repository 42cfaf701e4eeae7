"""Decode attention over the mixed cache (``hqekv::mixed_attention``) against FP16 SDPA.

A Llama-3-8B-shaped attention layer (32 query heads, 8 KV heads, head dim 128, random
weights) decodes one token over a cache of N tokens, N in 8K/32K/128K, for each bavg:

- ``sdpa``: the FP16 cache, ``scaled_dot_product_attention`` (the baseline),
- ``mixed_attention``: the HqeKV cache in its tiers, read packed by the Triton kernel,
- ``dequantize+sdpa``: the same cache dequantized into a dense buffer first, then SDPA
  (what a kernel that does not read packed chunks would pay).

Tiers: 10% of chunks at 1 bit, 5% evicted, 4/2-bit shares from bavg (SPEC §1.5), two
protected FP16 chunks, placed by a random importance; quantized by ``hqekv::quantize_pack``.
Times are medians of ``triton.testing.do_bench`` after warm-up, in the same process;
bytes are those the cache stores. Needs a CUDA GPU.

    python benchmarks/attention_kernels.py --out benchmarks/results/gpu_kernels.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hqekv import kernels  # noqa: E402
from hqekv.calibration import ratios_from_free  # noqa: E402
from hqekv.kernels.mixed_attention import gather_chunks  # noqa: E402
from hqekv.tiers import QUANTIZED_TIERS, TIER_FORMATS  # noqa: E402
from hqekv import policy  # noqa: E402
from hqekv.tiers import FP16  # noqa: E402

HQ, HKV, D, G = 32, 8, 128, 32


ONE_BIT_SHARE, EVICTED_SHARE = 0.1, 0.05
"""δ3, δ4 of the benchmark; δ1, δ2 follow from bavg (SPEC §1.5), so every tier is read."""


def tier_counts(n_chunks: int, bavg: float, protected: int = 2) -> tuple[list[int], int]:
    """Kept chunks per tier (FP16, 4, 2, 1 bit) and evicted chunks, counted by the policy."""
    ratios = ratios_from_free(bavg, ONE_BIT_SHARE, EVICTED_SHARE)
    counts = policy.tier_counts(torch.tensor([n_chunks - protected]), ratios)[0].tolist()
    return [counts[0] + protected, *counts[1:4]], counts[4]


def build_cache(n_tokens: int, bavg: float, dtype, device, gen):
    """A decode-ready mixed cache of ``n_tokens`` (one row) and the dense FP16 cache it came from."""
    n_chunks = n_tokens // G
    keys = torch.randn(n_chunks, HKV, G, D, generator=gen, device=device).to(dtype)
    values = torch.randn(n_chunks, HKV, G, D, generator=gen, device=device).to(dtype)
    kept_counts, n_evicted = tier_counts(n_chunks, bavg)
    order = torch.randperm(n_chunks, generator=gen, device=device)  # random importance
    kept = order[: n_chunks - n_evicted].sort().values
    tier_of = torch.full((n_chunks,), -1, dtype=torch.long, device=device)
    start = 0
    for t, n in enumerate(kept_counts):
        tier_of[order[start : start + n]] = t
        start += n
    tier = tier_of[kept][None]  # (1, C) logical order, evicted dropped
    slot = torch.full_like(tier, -1)
    pools = {"k": [], "v": []}
    for t in (FP16, *QUANTIZED_TIERS):
        at = (tier[0] == t).nonzero().flatten()
        slot[0, at] = torch.arange(at.numel(), device=device)
        for comp, dense in (("k", keys), ("v", values)):
            chunks = dense[kept[at]]
            if t == FP16:
                pools[comp].append(chunks)
            else:
                bits, normalized = TIER_FORMATS[t]
                pools[comp] += kernels.quantize_pack(chunks, bits, normalized, comp == "k", 32, torch.float16)
    dense_k = keys.permute(1, 0, 2, 3).reshape(1, HKV, n_chunks * G, D)
    dense_v = values.permute(1, 0, 2, 3).reshape(1, HKV, n_chunks * G, D)
    return pools, tier, slot, dense_k, dense_v, kept_counts, n_evicted


def bench(fn, device) -> float:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` on CUDA, a timed loop on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=50, rep=200, return_mode="median"))
    times = []
    for _ in range(7):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--bavg", type=float, nargs="+", default=[2.0, 3.2])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--out", default=None, help="default: benchmarks/results/gpu_kernels.json (cpu_kernels.json)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run on CPU (the fused C decode kernel, fp32) at the given lengths")  # fmt: skip
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = f"benchmarks/results/{'cpu' if args.cpu_smoke else 'gpu'}_kernels.json"
    if args.cpu_smoke:
        device, dtype = torch.device("cpu"), torch.float32
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    else:
        raise SystemExit("benchmarks/attention_kernels.py needs a CUDA GPU (or --cpu-smoke to check the script on CPU)")
    gen = torch.Generator(device=device).manual_seed(0)
    scaling = 1 / math.sqrt(D)
    q = torch.randn(1, HQ, 1, D, generator=gen, device=device).to(dtype)
    new_k = torch.randn(1, HKV, 1, D, generator=gen, device=device).to(dtype)
    new_v = torch.randn(1, HKV, 1, D, generator=gen, device=device).to(dtype)
    valid = torch.ones(1, 1, dtype=torch.bool, device=device)
    tail = torch.zeros(1, HKV, G, D, dtype=dtype, device=device)
    tail_len = torch.zeros(1, dtype=torch.long, device=device)
    rows = []
    for n in args.lengths:
        for bavg in args.bavg:
            t0 = time.perf_counter()
            pools, tier, slot, dense_k, dense_v, counts, n_evicted = build_cache(n, bavg, dtype, device, gen)
            k_all = torch.cat([dense_k, new_k], 2)
            v_all = torch.cat([dense_v, new_v], 2)
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, scale=scaling, enable_gqa=True)  # noqa: E731
            cache = kernels.PackedCache(pools["k"], pools["v"], tier, slot, tier, slot, tail, tail, tail_len, 32)
            mixed = lambda: kernels.mixed_attention(q, new_k, new_v, valid, scaling, *cache)  # noqa: E731

            def dequantized():
                k = torch.cat([gather_chunks(pools["k"], tier, slot, True, 32, dtype), new_k], 2)
                v = torch.cat([gather_chunks(pools["v"], tier, slot, False, 32, dtype), new_v], 2)
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=True)

            # correctness against the dequantized reference before timing
            ref = dequantized().transpose(1, 2)
            err = (mixed().float() - ref.float()).abs().max().item()
            t_sdpa, t_mixed, t_deq = bench(sdpa, device), bench(mixed, device), bench(dequantized, device)
            stored = sum(t.nbytes for comp in pools.values() for t in comp) + 4 * tier.nbytes
            row = {
                "context": n, "bavg": bavg, "chunks_fp16_4_2_1": counts, "chunks_evicted": n_evicted,
                "sdpa_ms": t_sdpa, "mixed_attention_ms": t_mixed, "dequantize_sdpa_ms": t_deq,
                "mixed_vs_sdpa_speed": t_sdpa / t_mixed, "dequantize_sdpa_vs_sdpa_speed": t_sdpa / t_deq,
                "cache_bytes_dense": dense_k.nbytes + dense_v.nbytes, "cache_bytes_hqekv": stored,
                "memory_ratio": stored / (dense_k.nbytes + dense_v.nbytes), "max_abs_err_vs_reference": err,
                "setup_s": time.perf_counter() - t0,
            }  # fmt: skip
            rows.append(row)
            print(
                f"N={n:>6} bavg={bavg}: sdpa {t_sdpa:.3f} ms, mixed_attention {t_mixed:.3f} ms "
                f"({row['mixed_vs_sdpa_speed']:.2f}x), dequantize+sdpa {t_deq:.3f} ms; "
                f"memory {row['memory_ratio']:.3f} of dense; max err {err:.2e}",
                flush=True,
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result = {
        "benchmark": "decode attention, one Llama-3-8B-shaped layer (32 q heads, 8 KV heads, D=128), batch 1",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke check, not a benchmark)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()

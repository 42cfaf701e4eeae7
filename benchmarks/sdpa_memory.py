"""What one chunk's SDPA holds on the CPU beyond its inputs: the DynamicCache side of
``benchmarks/peak_memory.py``, alone.

    python benchmarks/sdpa_memory.py                       # 2048 queries, 8K-32K keys, bf16 and fp32
    python benchmarks/sdpa_memory.py --lengths 16384 --out results/sdpa_memory-16k.json

A prompt chunk of a Llama-3-8B-shaped model under transformers' SDPA attention: 2048 queries
of 32 heads, dim 128, against the cache's keys and values expanded to the 32 query heads
(``repeat_kv``), with a boolean causal mask. Each (length, dtype) runs in a new process with
freed memory released at once (``MALLOC_MMAP_THRESHOLD_=65536``); the figure is the peak
resident set size during the one ``scaled_dot_product_attention`` call minus the resident
set size before it, next to the bytes of the expanded keys and values. On a CPU with
``amx_bf16``, torch's bf16 flash kernel packs the keys and values for its matrix units
(``pack_vnni2``: forced onto AVX2 with ``ATEN_CPU_CAPABILITY=avx2``, the call fails saying so),
and the call holds about 1.3 times their bytes beyond its output, a float32 call about 0.27
times: that copy is part of the DynamicCache's peak in ``peak_memory.py`` on such a CPU, and
not on one without (``machine.cpu_features`` in every result file says which).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
from common import RELEASE_FREED, PeakMeter, print_row, read_row, release_freed_env, save


def measure(length: int, dtype: str, queries: int, heads: int, head_dim: int) -> dict:
    """One SDPA call in this process: its peak beyond the resident set before it."""
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    q = torch.randn(1, heads, queries, head_dim, dtype=dt)
    k = torch.randn(1, heads, length, head_dim, dtype=dt)
    v = torch.randn(1, heads, length, head_dim, dtype=dt)
    mask = torch.ones(queries, length, dtype=torch.bool).tril(length - queries)[None, None]
    meter = PeakMeter("cpu", "one scaled_dot_product_attention call")
    meter.start()
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    peak = meter.stop() / 2**20
    kv_mib = 2 * k.numel() * k.element_size() / 2**20
    out_mib = out.numel() * out.element_size() / 2**20
    return dict(length=length, dtype=dtype, queries=queries, heads=heads, head_dim=head_dim,
                kv_mib=kv_mib, output_mib=out_mib, peak_beyond_mib=peak,
                beyond_output_to_kv=(peak - out_mib) / kv_mib)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768], help="cached tokens")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--queries", type=int, default=2048, help="the prompt chunk's tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sdpa_memory.json)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a case, run in this process
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        print_row(measure(**json.loads(args.one)))
        return
    rows = []
    for length in args.lengths:
        for dtype in args.dtypes:
            case = dict(length=length, dtype=dtype, queries=args.queries, heads=32, head_dim=128)
            cmd = [sys.executable, __file__, "--threads", str(args.threads), "--one", json.dumps(case)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=release_freed_env())
            row = read_row(done.stdout)
            if done.returncode or row is None:
                raise RuntimeError(f"case {case} failed:\n{done.stderr[-2000:]}")
            rows.append(row)
            print(f"{length:6d} keys {dtype:9s} K+V {row['kv_mib']:7.1f} MiB  peak beyond {row['peak_beyond_mib']:7.1f} MiB"
                  f"  (beyond the output: {row['beyond_output_to_kv']:.2f}x K+V)")  # fmt: skip
    method = PeakMeter("cpu", "one scaled_dot_product_attention call").method
    save("sdpa_memory", {"method": f"{method}, {RELEASE_FREED}", "rows": rows}, args.out)


if __name__ == "__main__":
    main()

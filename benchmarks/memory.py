"""Cache bytes of HqeKV vs the FP16 DynamicCache on SmolLM2, after a prefill.

    python benchmarks/memory.py [--lengths 1024 2048 4096] [--bavg 2 3.2]
"""

import argparse
import warnings

from common import dense_cache_bytes, essay_ids, load_smollm2, save

import torch
import hqekv


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--bavg", type=float, nargs="+", default=[2.0, 3.2])
    args = parser.parse_args()
    model, tok = load_smollm2()
    rows = []
    for n in args.lengths:
        ids = essay_ids(tok, n)
        with torch.no_grad():
            dense = dense_cache_bytes(model(ids, use_cache=True).cache)
        for bavg in args.bavg:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", hqekv.UncalibratedRatiosWarning)
                hqekv.patch_model(model, bavg=bavg)
            config = hqekv.patch_config(model)
            with torch.no_grad():
                report = hqekv.memory_report(model(ids, use_cache=True).cache)
            hqekv.unpatch_model(model)
            row = {
                "tokens": n,
                "bavg_target": bavg,
                "ratios": config.ratios.describe(),
                "ratios_source": config.ratios_source,
                "dynamic_cache_bytes": dense,
                "dynamic_cache_dtype": str(model.dtype),
                "ratio_to_dynamic_cache": report.total_bytes / dense,
                **report.to_dict(),
            }
            rows.append(row)
            print(
                f"{n:5d} tokens bavg {bavg:>4}: {report.total_bytes / 2**20:7.2f} MiB vs DynamicCache "
                f"{dense / 2**20:7.2f} MiB ({row['ratio_to_dynamic_cache']:.3f}x; "
                f"{report.ratio_to_fp16:.3f}x of FP16); bavg {report.bavg:.3f}, effective {report.effective_bits:.3f} bits"
            )
    save("memory", {"model": "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1)", "rows": rows})


if __name__ == "__main__":
    main()

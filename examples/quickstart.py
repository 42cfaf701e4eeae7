"""Patch SmolLM2, answer a question about a fact buried in a ~3K-token document, report memory.

    python examples/quickstart.py [--bavg 3.2] [--tokens 3000]
"""

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import hqekv  # noqa: E402
from hqekv.texts import chat, haystack_with_needle  # noqa: E402
from hqekv.packaged_models import SMOLLM2, load_model  # noqa: E402

FACT = "The password for the office wifi is BlueTiger42."
QUESTION = "What is the password for the office wifi?"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bavg", type=float, default=hqekv.DEFAULT_BAVG)
    parser.add_argument("--tokens", type=int, default=3000)
    args = parser.parse_args()

    model, tok, _ = load_model(SMOLLM2)

    document = haystack_with_needle(tok, args.tokens, FACT, depth=0.8)
    prompt = chat(tok, f"Read this document.\n\n{document}\n\nQuestion: {QUESTION}")
    inputs = tok(prompt, return_tensors="pt")
    print(f"prompt: {inputs.input_ids.shape[1]} tokens; question: {QUESTION}")

    for label in ("FP16 (unpatched)", f"HqeKV bavg={args.bavg:g}"):
        if label.startswith("HqeKV"):
            hqekv.patch_model(model, bavg=args.bavg)
            config = hqekv.patch_config(model)
            print(f"\nratios ({config.ratios_source}): {config.describe_ratios()}")
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
        seconds = time.perf_counter() - start
        answer = tok.decode(out.sequences[0, inputs.input_ids.shape[1] :], skip_special_tokens=True).strip()
        print(f"\n[{label}] {answer!r}  ({seconds:.1f} s)")
        if label.startswith("FP16"):
            dense = sum(layer.keys.nbytes + layer.values.nbytes for layer in out.cache.layers)
            print(f"  DynamicCache: {dense / 2**20:.2f} MiB ({out.cache.layers[0].keys.dtype})")
        else:
            report = hqekv.memory_report(out.cache)
            print("  " + str(report).replace("\n", "\n  "))
            print(f"  memory saved vs FP16: {1 - report.ratio_to_fp16:.1%}; vs this run's dense cache: "
                  f"{1 - report.ratio_to_dense:.1%}")
    hqekv.unpatch_model(model)


if __name__ == "__main__":
    main()

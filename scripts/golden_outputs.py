"""Fingerprints of what patched models compute, to prove a refactoring changes nothing.

    python scripts/golden_outputs.py --save golden.json    # before the change
    python scripts/golden_outputs.py --check golden.json   # after it: exit 1 on any difference

Each case runs one greedy ``model.generate`` and records, bit for bit, the generated tokens,
a SHA-256 of every step's logits (float32) and the cache's memory report (chunks per tier,
bytes per part). Cases: SmolLM2 with its shipped per-layer artifacts at bavg 2 and 3.2, with
the rate-distortion allocator (``ratios="auto"``), and with a prompt fed in chunks under
either; a batch of two prompts, the shorter left-padded; a static cache under
``torch.compile`` (transformers' ``compile_config``, fullgraph); tiny random Gemma3- and
Qwen3-shaped models (sliding layers, q/k norms). Floating-point results depend on the
machine and the thread count, so compare files made on one machine with the same
``--threads``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers: the tiny models of every family

import hqekv  # noqa: E402
from hqekv.patching import output_cache  # noqa: E402


def _smollm2():
    from hqekv.texts import essays
    from hqekv.packaged_models import SMOLLM2, load_model

    model, tokenizer, _ = load_model(SMOLLM2)
    ids = tokenizer(essays()[:6000], add_special_tokens=False, return_tensors="pt").input_ids[:, :700]
    return model, ids


def _tiny(family: str):
    from tests.helpers import tiny_model

    model = tiny_model(family)
    ids = torch.randint(3, model.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    return model, ids


def _compile_config():
    from transformers import CompileConfig

    config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told so
    return config


# name -> (model and prompt, patch_model arguments, generate arguments, batch of two rows)
CASES = {
    "smollm2-bavg2": (_smollm2, dict(bavg=2.0), {}, False),
    "smollm2-bavg3.2": (_smollm2, dict(bavg=3.2), {}, False),
    "smollm2-auto2.6": (_smollm2, dict(bavg=2.6, ratios="auto"), {}, False),
    "smollm2-bavg2-chunked": (_smollm2, dict(bavg=2.0), dict(prefill_chunk_size=128), False),
    "smollm2-auto2-chunked": (_smollm2, dict(bavg=2.0, ratios="auto"), dict(prefill_chunk_size=128), False),
    "smollm2-auto2-chunked-padded-batch": (_smollm2, dict(bavg=2.0, ratios="auto"), dict(prefill_chunk_size=128), True),
    "smollm2-bavg2-padded-batch": (_smollm2, dict(bavg=2.0), {}, True),
    "smollm2-bavg2-static-compiled": (_smollm2, dict(bavg=2.0), dict(compile_config=_compile_config), False),
    "gemma3-tiny": (lambda: _tiny("gemma3_text"), dict(ratios=(0.25, 0.25, 0.25, 0.25)), {}, False),
    "qwen3-tiny": (lambda: _tiny("qwen3"), dict(ratios=(0.25, 0.25, 0.25, 0.25)), {}, False),
}


def run_case(name: str, new_tokens: int) -> dict:
    load, patch, extra, batch = CASES[name]
    model, ids = load()
    hqekv.patch_model(model, **patch)
    mask = torch.ones_like(ids)
    if batch:
        ids, mask = torch.cat([ids, ids.roll(37, 1)]), torch.cat([mask, mask])
        mask[1, :90] = 0  # the second row is 90 tokens shorter, padded on the left
    extra = {k: v() if callable(v) else v for k, v in extra.items()}
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            return_dict_in_generate=True, output_logits=True, **({} if "compile_config" in extra else
                                                                  {"disable_compile": True}), **extra,
        )  # fmt: skip
    logits = torch.stack(out.logits).float().contiguous()
    report = hqekv.memory_report(output_cache(out))
    return {
        "tokens": out.sequences[:, ids.shape[1] :].tolist(),
        "logits_sha256": hashlib.sha256(logits.numpy().tobytes()).hexdigest(),
        "logits_sum": float(logits.double().sum()),
        "chunks": report.chunks,
        "bytes_by_part": report.bytes_by_part,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--save", metavar="JSON", help="record the fingerprints")
    action.add_argument("--check", metavar="JSON", help="compare with recorded fingerprints")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    found = {"threads": args.threads, "new_tokens": args.new_tokens, "torch": torch.__version__, "cases": {}}
    for name in args.cases:
        found["cases"][name] = run_case(name, args.new_tokens)
        print(f"{name:32s} {found['cases'][name]['logits_sha256'][:16]}", flush=True)
    if args.save:
        Path(args.save).write_text(json.dumps(found, indent=1) + "\n")
        print(f"saved {args.save}")
        return
    recorded = json.loads(Path(args.check).read_text())
    if (recorded["threads"], recorded["new_tokens"]) != (args.threads, args.new_tokens):
        sys.exit(f"recorded with --threads {recorded['threads']} --new-tokens {recorded['new_tokens']}: run the same")
    differ = [n for n in args.cases if recorded["cases"].get(n) != found["cases"][n]]
    for name in differ:
        before, after = recorded["cases"].get(name) or {}, found["cases"][name]
        print(f"DIFFERS {name}: " + ", ".join(k for k in after if before.get(k) != after[k]))
    print(f"{len(args.cases) - len(differ)} of {len(args.cases)} cases bit-equal")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()

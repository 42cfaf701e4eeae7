"""Decode tokens/s of HqeKV vs the FP16 DynamicCache through ``model.generate``, same process, on SmolLM2.

    python benchmarks/decode.py [--lengths 2048 4096 8128] [--new-tokens 32] [--bavg 2 3.2 auto:2.8]
                                [--dtype float32] [--no-compile] [--repeats 3]

Each run is one greedy ``model.generate`` call after a prompt of the given length; a logits
processor stamps the time after every step, so decode tokens/s is timed over the steps
after the first (prefill excluded, re-ranking every 32 tokens included), and each figure is
the best of ``--repeats`` passes over every configuration; 8128 prompt tokens keep prompt and continuation within
SmolLM2's 8192 positions. Rows:

- ``dynamic_cache``: the unpatched model, eager — the baseline of every ratio;
- ``hqekv`` per bavg: the patched model, eager; ``auto:B`` is ``patch_model(model, B,
  ratios="auto")``, the rate-distortion allocator (its re-ranks cost more: the seconds spent
  re-ranking per re-rank of a layer, ``rerank_ms``, are reported for every bavg), each layer
  at its own budget where the model's layer profile splits it; ``shared:B`` the allocator
  with one budget the layers share (``layer_bits="shared"``); ``heads:B`` the allocator with
  tiers per KV head (``head_tiers=True``);
- ``hqekv_compiled`` per bavg: ``generate(..., compile_config=CompileConfig(fullgraph=True))``,
  the decode step compiled by transformers as one whole graph (compiled once on a short
  prompt before timing; the compile time is reported apart);
- ``loop``: the same steps as a hand-written loop of ``model(...)`` calls (the former
  measurement), for the DynamicCache and the first bavg.
"""

import argparse
import time
import warnings

import torch
from common import essay_ids, load_smollm2, save
from transformers import CompileConfig, LogitsProcessor, LogitsProcessorList

import hqekv
from hqekv.eval.methods import parse_method
from hqekv.eval.tasks import greedy_generate


class StepClock(LogitsProcessor):
    """Records the time after each forward of ``generate`` (logits processors run once per step)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        if scores.is_cuda:
            torch.cuda.synchronize()  # the step's kernels are done, not just launched
        self.times.append(time.perf_counter())
        return scores


def compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True)  # the decode step is one whole graph
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told so
    return config


def generate(model, ids, new_tokens, compiled=False):
    """-> decode tokens/s over the steps after the first, and the generated ids."""
    clock = StepClock()
    extra = {"compile_config": compile_config()} if compiled else {"disable_compile": True}
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, do_sample=False,
            logits_processor=LogitsProcessorList([clock]), **extra,
        )  # fmt: skip
    steps = clock.times
    return (len(steps) - 1) / (steps[-1] - steps[0]), out[0, ids.shape[1] :]


def loop(model, ids, new_tokens):
    """Decode tokens/s of a hand-written greedy loop of ``model(...)`` calls."""
    _, _, decode_s, _, _ = greedy_generate(model, ids, new_tokens + 1)
    return new_tokens / decode_s


def patch(model, bavg):
    """``bavg`` a number (shipped or fallback ratios) or a method of ``hqekv eval``
    (:mod:`hqekv.eval.methods`): ``"auto:B"`` (the rate-distortion allocator, each layer at its
    own budget where a layer profile splits it), ``"shared:B"`` (the allocator with one budget
    its layers share), ``"heads:B"`` (``auto:B`` with tiers per KV head), ..."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hqekv.UncalibratedRatiosWarning)
        if ":" in str(bavg):
            hqekv.patch_model(model, **parse_method(str(bavg)).patch_kwargs())
        else:
            hqekv.patch_model(model, bavg=float(bavg))


class RerankClock:
    """Wall time of every decode-time ``HqeKVLayer.rerank`` call while installed (a layer
    re-ranks its prefill before it holds tokens: those are not counted)."""

    def __init__(self):
        self.seconds: list[float] = []

    def __enter__(self):
        from hqekv.cache import HqeKVLayer

        self.original = original = HqeKVLayer.rerank
        clock = self

        def timed(layer, rows, **kwargs):
            start = time.perf_counter()
            original(layer, rows, **kwargs)
            if layer.has_tokens:
                clock.seconds.append(time.perf_counter() - start)

        HqeKVLayer.rerank = timed
        return self

    def __exit__(self, *exc):
        from hqekv.cache import HqeKVLayer

        HqeKVLayer.rerank = self.original


def measure(model, prompts: dict, warm, bavgs, new_tokens: int, compiled: bool = True, with_loop: bool = False,
            repeats: int = 1):  # fmt: skip
    """Decode tokens/s of every prompt: the unpatched model, then hqekv at each bavg, eager and
    (``compiled``) through ``generate``'s compiled step; ``with_loop``: also the hand-written
    loop at the first bavg. ``repeats`` passes over every configuration, each figure the best
    of its passes (a burst of load on the machine then slows one pass of a configuration,
    not all of them). -> (a row per prompt length, compile seconds per bavg, first pass)."""
    best: dict = {}
    tokens: dict = {}
    compile_s = {}
    rerank_ms = {}

    def keep(cell, tps, out=None):
        print(f"  {' '.join(map(str, cell))}: {tps:.1f} tok/s", flush=True)  # progress, should a run be cut short
        best[cell] = max(best.get(cell, 0.0), tps)
        if out is not None:
            tokens.setdefault(cell, out)

    for _ in range(repeats):
        for n, ids in prompts.items():
            keep(("dynamic", n), *generate(model, ids, new_tokens))
            if with_loop:
                keep(("loop dynamic", n), loop(model, ids, new_tokens))
        for bavg in bavgs:
            patch(model, bavg)  # a new patch is new code to compile
            if compiled:
                start = time.perf_counter()
                generate(model, warm, 8, compiled=True)  # compiles the decode step
                compile_s.setdefault(str(bavg), time.perf_counter() - start)
            for n, ids in prompts.items():
                with RerankClock() as reranks:
                    keep(("eager", bavg, n), *generate(model, ids, new_tokens))
                if reranks.seconds:  # per layer
                    rerank_ms[(bavg, n)] = min(rerank_ms.get((bavg, n), 1e9), 1000 * min(reranks.seconds))
                if with_loop and bavg == bavgs[0]:
                    keep(("loop", n), loop(model, ids, new_tokens))
                if compiled:
                    keep(("compiled", bavg, n), *generate(model, ids, new_tokens, compiled=True))
            hqekv.unpatch_model(model)

    rows = {}
    for n in prompts:
        base_tps = best[("dynamic", n)]
        row = rows[n] = {"tokens": n, "new_tokens": new_tokens, "dynamic_cache": {"decode_tokens_per_s": base_tps},
                         "hqekv": {}, "hqekv_compiled": {}}  # fmt: skip
        for bavg in bavgs:
            tps, out = best[("eager", bavg, n)], tokens[("eager", bavg, n)]
            row["hqekv"][str(bavg)] = {"decode_tokens_per_s": tps, "ratio": tps / base_tps,
                                       "same_tokens_fraction": float((out == tokens[("dynamic", n)]).float().mean()),
                                       "rerank_ms": rerank_ms.get((bavg, n))}  # fmt: skip
            if compiled:
                ctps = best[("compiled", bavg, n)]
                row["hqekv_compiled"][str(bavg)] = {
                    "decode_tokens_per_s": ctps, "ratio": ctps / base_tps,
                    "same_tokens_as_eager": bool(torch.equal(tokens[("compiled", bavg, n)], out)),
                }  # fmt: skip
        if with_loop:
            row["loop"] = {"dynamic_cache": best[("loop dynamic", n)], "hqekv": best[("loop", n)], "bavg": bavgs[0],
                           "ratio": best[("loop", n)] / best[("loop dynamic", n)]}  # fmt: skip
    for row in rows.values():
        parts = [f"{row['tokens']:6d} tokens: DynamicCache {row['dynamic_cache']['decode_tokens_per_s']:.1f} tok/s"]
        for bavg in bavgs:
            e = row["hqekv"][str(bavg)]
            text = f"bavg {bavg}: eager {e['decode_tokens_per_s']:.1f} ({e['ratio']:.2f}x)"
            if e["rerank_ms"] is not None:
                text += f" [re-rank {e['rerank_ms']:.1f} ms/layer]"
            if compiled:
                c = row["hqekv_compiled"][str(bavg)]
                text += f", compiled {c['decode_tokens_per_s']:.1f} ({c['ratio']:.2f}x)"
            parts.append(text)
        if with_loop:
            parts.append(f"loop bavg {bavgs[0]}: {row['loop']['ratio']:.2f}x")
        print("; ".join(parts), flush=True)
    print("compile seconds (short prompt, once per bavg):", compile_s)
    return list(rows.values()), compile_s


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8128])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--bavg", nargs="+", default=["2", "3.2"],
                        help="bits per element: B (shipped or fallback ratios), or a method of hqekv eval: auto:B "
                        "(ratios='auto'), shared:B (ratios='auto', layer_bits='shared'), heads:B (head_tiers=True)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled runs")
    parser.add_argument("--repeats", type=int, default=3, help="passes over every configuration, the best kept")
    parser.add_argument("--out", help="results name (default: decode, or decode-<dtype>)")
    args = parser.parse_args()
    model, tok = load_smollm2()
    model = model.to(getattr(torch, args.dtype))
    warm = essay_ids(tok, 256)
    generate(model, warm, 4)  # warm-up
    prompts = {n: essay_ids(tok, n) for n in args.lengths}
    rows, compile_s = measure(model, prompts, warm, args.bavg, args.new_tokens, not args.no_compile, with_loop=True,
                              repeats=args.repeats)  # fmt: skip
    save(args.out or (f"decode-{args.dtype}" if args.dtype != "float32" else "decode"), {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1)", "device": "cpu", "dtype": args.dtype,
        "path": "fused C kernel for decode attention (hqekv/kernels/csrc), PyTorch reference for the prefill",
        "measured_through": "model.generate (greedy), eager and compile_config (fullgraph=True; a static cache)",
        "repeats": args.repeats, "figure": f"best decode tokens/s of {args.repeats} passes over every configuration",
        "compile_seconds": compile_s, "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()

"""Peak memory of a prefill plus decode tokens through ``model.generate``: DynamicCache
against hqekv, one-shot and chunked (``prefill_chunk_size``), each case in a fresh process.

    python benchmarks/peak_memory.py                       # the CPU cases below
    python benchmarks/peak_memory.py --cases llama3-8b-attn:32768 --chunks 2048 --bavg 2
    python benchmarks/peak_memory.py --cases llama3-8b-attn:32768 --chunks 2048 --bavg 2 --layers 8  # deeper
    python benchmarks/peak_memory.py --cases llama3-8b-attn:32768 --chunks 2048 --bavg 2 2:wait-4bit 2:evict  # the three rules
    python benchmarks/peak_memory.py --cases llama3-8b:32768 --dtype bfloat16 --out ...  # on a GPU

A case is ``MODEL:TOKENS``. MODEL is a packaged model (``smollm2``, ``qwen2.5-coder``; the
prompt is the essays, in the model's dtype) or a random-weight Llama shape
(``llama3-8b-attn``: Llama-3-8B's attention — hidden 4096, 32 query heads, 8 KV heads of
dim 128 — with 4 layers, a 1024-wide MLP and a 32K vocabulary, so that on a CPU the cache
and the attention dominate as they do for users of 8B models; ``llama3-8b``: the whole
model, for a GPU). Every (case, cache, chunk) runs in a new Python process that loads the
model, runs a short warm-up ``generate`` (thread pools, kernel libraries), then measures one
greedy ``generate`` of the prompt plus ``--new-tokens`` tokens:

- on CUDA: ``torch.cuda.max_memory_allocated()`` during it, minus what was allocated before
  it (the weights);
- on CPU: the peak resident set size of the process during it (``VmHWM``, reset through
  ``/proc/self/clear_refs`` just before), minus the resident set size before it: the peak
  memory beyond what the loaded model holds, every allocation counted. With glibc's
  default allocator this includes freed memory the heap keeps (how much varies from run to
  run); ``--release-freed`` runs every case with ``MALLOC_MMAP_THRESHOLD_=65536``, so that
  a freed block of 64 KiB or more goes back to the system at once and the peak is that of
  the memory in use (slower: every such block is a system call).

Each row also gives the cache's own bytes at the end (hqekv: its memory report; the
DynamicCache: its key and value tensors), the prefill seconds (to the first token) and the
attention each side ran: the model's SDPA for the DynamicCache and hqekv's first prompt
chunk, hqekv's ``mixed_attention`` for later chunks. Results: JSON under
``benchmarks/results/``, and the ratio of each hqekv peak to the DynamicCache's with the same
chunks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from common import RELEASE_FREED, PeakMeter, essay_ids, patch_arguments, print_row, read_row, release_freed_env, save

SHAPES = {
    "llama3-8b-attn": dict(hidden_size=4096, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, vocab_size=32000, rope_theta=500000.0,
                           max_position_embeddings=131072),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=131072),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=8192),
}  # fmt: skip
CPU_CASES = ["smollm2:4096", "smollm2:8192", "qwen2.5-coder:16384", "llama3-8b-attn:16384", "llama3-8b-attn:32768"]


def load(model_name: str, dtype: str | None, device: str, layers: int | None = None):
    """-> model, and a function of n giving an (1, n) prompt; ``layers``: a random shape's
    depth instead of its own."""
    if model_name in SHAPES:
        from transformers import LlamaConfig, LlamaForCausalLM

        shape = {**SHAPES[model_name], **({"num_hidden_layers": layers} if layers else {})}
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**shape)).to(getattr(torch, dtype or "bfloat16")).eval()
        gen = torch.Generator().manual_seed(0)
        return model, lambda n: torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(device)
    from hqekv.packaged_models import load_model

    model, tokenizer, _ = load_model(model_name, dtype=getattr(torch, dtype) if dtype else None)
    return model.to(device), lambda n: essay_ids(tokenizer, n).to(device)


def cache_bytes(cache) -> int:
    from hqekv.eval import cache_memory

    return cache_memory(cache)["cache_bytes"]


def run_one(spec: dict) -> dict:
    """One measurement, in this process (a fresh one: see :func:`main`)."""
    import hqekv
    from hqekv.eval.tasks import output_cache

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    began = time.perf_counter()

    def progress(what: str) -> None:  # to stderr as it happens: a case cut short still says where it was
        print(f"  [{spec['cache']} {spec['tokens']}] {what} at {time.perf_counter() - began:.1f} s", file=sys.stderr,
              flush=True)  # fmt: skip

    model, prompt = load(spec["model"], spec.get("dtype"), device, spec.get("layers"))
    progress("model loaded")
    if spec["cache"] != "dynamic":
        hqekv.patch_model(model, **patch_arguments(spec["cache"]))
    ids = prompt(spec["tokens"])
    times = []

    class Clock:  # a logits processor: called once per step, the first time right after the prefill
        def __call__(self, input_ids, scores):
            times.append(time.perf_counter())
            return scores

    def generate(x, n):
        with torch.no_grad():
            return model.generate(
                x, max_new_tokens=n, min_new_tokens=n, do_sample=False, prefill_chunk_size=spec["chunk"],
                return_dict_in_generate=True, logits_processor=[Clock()], disable_compile=True,
            )  # fmt: skip

    generate(prompt(min(512, spec["tokens"])), 2)  # warm-up: thread pools, kernel libraries
    progress("warmed up")
    del times[:]
    meter = PeakMeter(device)
    meter.start()
    start = time.perf_counter()
    out = generate(ids, spec["new_tokens"])
    peak = meter.stop()
    progress(f"prefill {times[0] - start:.1f} s, then {len(times) - 1} decode steps in {times[-1] - times[0]:.1f} s")
    cache = output_cache(out)
    row = {
        **spec,
        "device": device,
        "peak_bytes": peak,
        "cache_bytes": cache_bytes(cache),
        "prefill_s": times[0] - start,
        "prefill_tokens_per_s": spec["tokens"] / (times[0] - start),
        "weights_bytes": sum(p.nbytes for p in model.parameters()),
        "method": meter.method,
        "attention": "model SDPA" if spec["cache"] == "dynamic" else (
            "model SDPA for the first prompt chunk, hqekv mixed_attention for the others"
            if spec["chunk"] else "model SDPA for the prompt, hqekv mixed_attention for decoding"),
    }  # fmt: skip
    if spec["cache"] != "dynamic":
        row["memory_report"] = hqekv.memory_report(cache).to_dict()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=CPU_CASES, help="MODEL:TOKENS (default: %(default)s)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 2048], help="prefill chunk sizes; 0 = one-shot")
    parser.add_argument("--bavg", nargs="+", default=["2", "3.2"], help="hqekv settings: B, B:auto (ratios='auto'), B:evict or B:wait-4bit (chunked_prefill), B:auto:evict")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", help="model dtype (default: bfloat16 for random shapes, the packaged one otherwise)")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--layers", type=int, help="decoder layers of a random shape (default: its own; 4 for llama3-8b-attn)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/peak_memory.json)")
    parser.add_argument("--release-freed", action="store_true",
                        help=f"CPU: run the cases with {RELEASE_FREED} (glibc: freed blocks go back at once)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a single case as JSON: run it here, print its row
    args = parser.parse_args()
    for setting in args.bavg:
        patch_arguments(setting)  # a typo fails here, not after the baseline ran
    if args.one:
        print_row(run_one(json.loads(args.one)))
        return
    header = {"measured_through": "model.generate (greedy), each case in a fresh process",
              "method": PeakMeter("cuda" if torch.cuda.is_available() else "cpu").method,
              "allocator": RELEASE_FREED if args.release_freed else "default"}  # fmt: skip
    env = release_freed_env() if args.release_freed else None
    rows = []
    for case in args.cases:
        model_name, tokens = case.rsplit(":", 1)
        for chunk in args.chunks:
            base = None
            for cache in ["dynamic", *args.bavg]:
                spec = dict(model=model_name, tokens=int(tokens), chunk=chunk or None, cache=cache,
                            new_tokens=args.new_tokens, dtype=args.dtype, threads=args.threads,
                            **({"layers": args.layers} if args.layers else {}))  # fmt: skip
                # the case's stderr (its progress, any traceback) goes straight to ours
                done = subprocess.run(
                    [sys.executable, __file__, "--one", json.dumps(spec)], stdout=subprocess.PIPE, text=True, env=env
                )
                row = read_row(done.stdout)
                if done.returncode or row is None:
                    rows.append({**spec, "error": f"exit status {done.returncode} (its stderr is above)"})
                    continue
                if cache == "dynamic":
                    base = row
                elif base is not None:
                    row["peak_to_dynamic"] = row["peak_bytes"] / base["peak_bytes"]
                    row["prefill_speed_to_dynamic"] = row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]
                rows.append(row)
                mib = 2**20
                print(
                    f"{case:24s} chunk {chunk or '-':>5} {cache:8s} peak {row['peak_bytes'] / mib:8.1f} MiB "
                    f"cache {row['cache_bytes'] / mib:8.1f} MiB prefill {row['prefill_tokens_per_s']:7.1f} tok/s"
                    + (f"  peak/dynamic {row['peak_to_dynamic']:.3f}" if "peak_to_dynamic" in row else ""),
                    flush=True,
                )
                save("peak_memory", {**header, "rows": rows}, args.out)  # after every row: a timeout keeps the rest


if __name__ == "__main__":
    main()

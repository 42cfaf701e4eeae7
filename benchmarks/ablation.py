"""What hqekv adds to the paper, on and off at equal bytes: per-layer budgets, the rotation, separate key/value ratios.

    python benchmarks/ablation.py --only-length 4096 --out docs/results/ablation \
        --methods fp16 kivi:2 rkivi:2 paper:2 hqekv:2 symrot:2 asym:2 asymrot:2 paper:3.2 hqekv:3.2 asym:3.2 asymrot:3.2

Runs ``hqekv eval``'s needle and perplexity tasks on SmolLM2 (fp32) for each setting
(:data:`ROWS`): ``paper:B`` (the shipped ratios as one set for every layer, no rotation),
``hqekv:B`` (the defaults: the shipped per-layer budgets split from that set),
``rhqekv:B`` / ``rpaper:B`` (per-layer / one set, rotated), and variants whose ratios come from studies run in
another setting, kept in ``docs/results/ablation/artifacts/`` (:data:`VARIANTS`):
``symrot:B`` (one set of ratios searched rotated), ``asym:B`` / ``asymrot:B`` (key and
value ratios searched apart, rotated, used without / with the rotation); ``kivi:2`` and
``rkivi:2`` show the 2-bit tier alone without and with the rotation. Any ``hqekv eval``
method spec is accepted too.

``--samples``/``--lengths`` define the sample set exactly as ``hqekv eval`` does (samples
are drawn round-robin over the lengths); ``--only-length`` runs the samples of one length
of that set, so that records of a full ``hqekv eval`` run with the same set (``--reuse``,
methods renamed with ``--rename PATH@old=new`` when the code path is the same) are the same
samples. Writes ``records.json`` first, then ``results.json``/``results.md``/plots (as
``hqekv eval``) and ``ablation.md``, the table of ``docs/results.md``.
"""

import argparse
import statistics
import sys
from pathlib import Path

from common import load_smollm2

import torch

from hqekv.eval import evaluate, parse_method, write_results
from hqekv.eval.methods import Method
from hqekv.eval.runner import summarize

ARTIFACTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "ablation" / "artifacts"
VARIANTS = {
    # name: (artifact tag in ARTIFACTS, rotation)
    "asymrot": ("asym-rot", "hadamard"),
    "asym": ("asym-rot", None),
    "symrot": ("sym-rot", "hadamard"),
}


class Variant(Method):
    """An ablation setting: the ratios of an artifact searched in another setting, with a rotation."""

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.bits:g}"

    def patch_kwargs(self) -> dict:
        tag, rotation = VARIANTS[self.kind]
        return {"artifact": ARTIFACTS / f"smollm2-{tag}-bavg{self.bits:g}.safetensors", "rotation": rotation}


def make_method(spec: str) -> Method:
    kind, _, bits = spec.partition(":")
    return Variant(kind, float(bits)) if kind in VARIANTS else parse_method(spec)

ROWS = {
    # kind: (rotation, ratios)
    "paper": ("off", "shipped: one set for every layer, K and V, searched unrotated (the paper)"),
    "hqekv": ("off", "shipped: per-layer budgets split from that set (the default)"),
    "rhqekv": ("on", "shipped: per-layer budgets split from that set"),
    "rpaper": ("on", "shipped: one set for every layer, searched unrotated"),
    "symrot": ("on", "one set for K and V, searched rotated"),
    "asym": ("off", "K and V apart, searched rotated"),
    "asymrot": ("on", "K and V apart, searched rotated"),
    "random": ("on", "shipped, chunks assigned at random (control)"),
    "kivi": ("off", "every chunk {bits}-bit (KIVI)"),
    "rkivi": ("on", "every chunk {bits}-bit"),
}
DEFAULT_METHODS = [f"{k}:{b}" for b in ("2", "3.2") for k in ("hqekv", "symrot", "asym", "asymrot", "random")] + ["rkivi:2"]


def ablation_table(rows: list[dict]) -> str:
    """Markdown: per bavg, each setting's effective bits, needle and perplexity (and vs fp16: the
    pooled perplexity's ratio, and the mean per-sample distance of the NLL from fp16's)."""
    by = {(r["method"], r["task"]): r for r in rows}
    fp16 = {t: by.get(("fp16", t), {}).get("score") for t in ("needle", "ppl")}
    lines = [
        f"fp16: needle {fp16['needle']:.2f}, perplexity {fp16['ppl']:.3f}" if None not in fp16.values() else "",
        "",
        "| bavg | method | rotation | ratios | effective bits | needle | perplexity | vs fp16 | mean abs ΔNLL vs fp16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    methods = {r["method"] for r in rows if r["method"].split(":")[0] in ROWS}
    for method in sorted(methods, key=lambda m: (float(m.split(":")[1]), list(ROWS).index(m.split(":")[0]))):
        needle, ppl = by.get((method, "needle")), by.get((method, "ppl"))
        present = [r for r in (needle, ppl) if r is not None]
        if not present:  # a run of other tasks: its rows are in results.md
            continue
        bits = statistics.fmean(r["effective_bits"] for r in present)
        rel = f"{100 * (ppl['score'] / fp16['ppl'] - 1):+.2f}%" if ppl and fp16["ppl"] else ""
        deviation = f"{ppl['nll_deviation_from_fp16']:.4f}" if ppl and "nll_deviation_from_fp16" in ppl else ""
        rotation, ratios = ROWS[method.split(":")[0]]
        ratios = ratios.format(bits=method.split(":")[1])
        lines.append(
            f"| {method.split(':')[1]} | {method} | {rotation} | {ratios} | {bits:.2f} | "
            f"{needle['score'] if needle else float('nan'):.2f} | {ppl['score'] if ppl else float('nan'):.3f} | {rel} | "
            f"{deviation} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import json

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", nargs="*", default=DEFAULT_METHODS)
    p.add_argument("--tasks", nargs="+", default=["needle", "ppl"])
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 7936])
    p.add_argument("--only-length", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", nargs="*", default=[],
                   help="results.json files of runs with the same --samples/--lengths/--seed (hqekv eval or this script)")
    p.add_argument("--rename", nargs="*", default=[],
                   help="PATH@old=new: the records of method old in reused file PATH count as new")  # fmt: skip
    p.add_argument("--threads", type=int)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.only_length not in args.lengths:
        p.error(f"--only-length {args.only_length} is not one of --lengths {args.lengths}")
    rename = {}
    for item in args.rename:
        source, _, pair = item.rpartition("@")
        old, new = pair.split("=", 1)
        rename.setdefault(source, {})[old] = new
    shard = (args.lengths.index(args.only_length), len(args.lengths))

    records = []
    for path in args.reuse:
        old = json.loads(Path(path).read_text())
        s = old["settings"]
        if (s["samples"], s["lengths"], s["seed"]) != (args.samples, args.lengths, args.seed):
            p.error(f"{path} was run with another sample set: {s['samples']}, {s['lengths']}, seed {s['seed']}")
        names = rename.get(path, {})
        for r in old["records"]:
            method = names.get(r["method"], r["method"])
            if r["length"] == args.only_length and method not in args.methods:
                records.append(dict(r, method=method))
    model, tokenizer = load_smollm2()
    records += evaluate(model, tokenizer, [make_method(m) for m in args.methods], args.tasks, samples=args.samples, lengths=args.lengths,
                        seed=args.seed, shard=shard)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.json").write_text(json.dumps(records) + "\n")  # first, so that no later error loses them
    methods = sorted({r["method"] for r in records})
    command = "python " + " ".join(["benchmarks/ablation.py", *sys.argv[1:]]) if argv is None else ""
    settings = {"model_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "model_dtype": str(model.dtype), "methods": methods,
                "tasks": args.tasks, "samples": args.samples, "lengths": args.lengths, "only_length": args.only_length,
                "seed": args.seed, "reused": args.reuse, "renamed": rename, "command": command}  # fmt: skip
    write_results(records, args.out, settings)
    table = ablation_table(summarize(records))
    (Path(args.out) / "ablation.md").write_text(f"```\n{command}\n```\n\n" + table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

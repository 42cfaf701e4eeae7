"""Run tasks × methods, summarize per method and task, write JSON, a markdown table and plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Sequence

import torch

from .methods import Method, parse_method
from .tasks import TASK_GROUPS, Reference, TASKS, expand_tasks, f1_score

DEFAULT_METHODS = ("fp16", "kivi:2", "kivi:4", "evict:2", "hqekv:2", "hqekv:3.2")
DEFAULT_TASKS = ("needle", "squad", "ppl")
RESULTS_VERSION = 1


def cache_memory(cache) -> dict:
    """Real bytes of a cache after a run, and bits per stored K/V element."""
    from ..cache import HqeKVCache

    if isinstance(cache, HqeKVCache):
        r = cache.memory_report()
        return {"cache_bytes": r.total_bytes, "elements": r.elements, "effective_bits": r.effective_bits, "bavg": r.bavg}
    if hasattr(cache.layers[0], "_quantized_keys"):  # transformers' QuantizedCache: codes + residual
        nbytes = elements = 0
        for layer in cache.layers:
            stored = [layer._quantized_keys, layer._quantized_values, layer.keys, layer.values]
            nbytes += sum(t.nbytes for x in stored for t in _leaf_tensors(x))
            b, h, _, d = layer._quantized_keys.shape
            elements += 2 * b * h * layer.cumulative_length * d
        return {"cache_bytes": nbytes, "elements": elements, "effective_bits": 8 * nbytes / elements,
                "bavg": float(cache.layers[0].nbits)}  # fmt: skip
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    nbytes = sum(t.nbytes for t in tensors)
    elements = sum(t.numel() for t in tensors)
    bits = 8 * tensors[0].element_size()
    return {"cache_bytes": nbytes, "elements": elements, "effective_bits": 8 * nbytes / elements, "bavg": bits}


def _leaf_tensors(x) -> list:
    """The plain tensors a (possibly quantized, subclassed) tensor is made of."""
    if hasattr(x, "__tensor_flatten__"):
        names, _ = x.__tensor_flatten__()
        return [t for n in names for t in _leaf_tensors(getattr(x, n))]
    return [x]


MIN_LENGTH = 64


def check_request(methods, tasks, samples: int, lengths) -> list[Method]:
    """Parsed methods, or a ``ValueError`` for unknown methods or tasks, no samples, or lengths
    under :data:`MIN_LENGTH` tokens: checked before any model runs (``hqekv eval`` checks
    before it loads the model)."""
    methods = [m if isinstance(m, Method) else parse_method(m) for m in methods]
    unknown = [t for t in expand_tasks(tasks) if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; available: {', '.join([*TASKS, *TASK_GROUPS])}")
    if samples < 1 or not lengths or min(lengths) < MIN_LENGTH:
        raise ValueError(
            f"need samples >= 1 and lengths >= {MIN_LENGTH} tokens, got samples={samples}, lengths={list(lengths)}"
        )
    return methods


def check_methods(model, methods: Sequence[Method]) -> None:
    """Each method applied to ``model`` and its cache made once, before any sample runs: a
    method the model cannot take (transformers' quantized cache on a model with sliding-window
    layers, say) fails here with its name, not after the methods before it ran."""
    for method in methods:
        try:
            with method.applied(model):
                method.new_cache(model)
        except ValueError as error:
            raise ValueError(f"method {method.name} cannot run on this model: {error}") from error


def evaluate(
    model,
    tokenizer,
    methods: Sequence[str | Method] = DEFAULT_METHODS,
    tasks: Sequence[str] = DEFAULT_TASKS,
    *,
    samples: int = 4,
    lengths: Sequence[int] = (1024, 2048),
    seed: int = 0,
    shard: tuple[int, int] = (0, 1),
    progress: bool = True,
    prefill_chunk: int | None = None,
    chunked_prefill: str | None = None,
    on_record=None,
    done: dict | None = None,
) -> list[dict]:
    """Per-sample records of every method on every task (this shard's samples only).

    Samples are generated from ``seed`` and split round-robin: shard ``(rank, world)``
    runs samples ``rank, rank + world, ...``, so the shards of one run merge into it.
    ``prefill_chunk``: every method reads each prompt in forwards of that many tokens, as
    ``generate(prefill_chunk_size=...)`` does (a compressed cache compresses between them);
    ``chunked_prefill``: what every hqekv method's cache does meanwhile (``patch_model``'s
    argument; None: its default).
    ``on_record(record)`` is called with each record as it is made (``hqekv eval`` keeps them
    on disk, so that a run cut short keeps what it finished); ``done`` maps (task, method name,
    index) to the records a run cut short made, which are returned as they are, not run again.
    """
    from tqdm.auto import tqdm

    from ..patching import is_patched

    if is_patched(model):
        raise ValueError("evaluate an unpatched model: each method patches it for its own runs")
    methods = check_request(methods, tasks, samples, lengths)
    check_methods(model, methods)
    tasks = expand_tasks(tasks)
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk={prefill_chunk}: a prompt chunk needs at least one token")
    if chunked_prefill is not None and prefill_chunk is None:
        raise ValueError(f"chunked_prefill={chunked_prefill!r} says what a cache does with a prompt fed in pieces; "
                         "it needs prefill_chunk")  # fmt: skip
    settings = {} if chunked_prefill is None else {"chunked_prefill": chunked_prefill}
    rank, world = shard
    records = []
    for task_name in tasks:
        task = TASKS[task_name]
        mine = list(enumerate(task.samples(tokenizer, samples, list(lengths), seed)))[rank::world]
        answers = {}  # sample index -> fp16's answer (token ids), every other method's reference
        for method in sorted(methods, key=lambda m: m.name != "fp16"):  # fp16 first: its answers are the references
            with method.applied(model, **settings) as config:
                for index, sample in tqdm(mine, desc=f"{task_name} {method.name}", disable=not progress):
                    made = (done or {}).get((task_name, method.name, index))
                    if made is not None:
                        if made["sample"] != sample.id:
                            raise ValueError(f"the record of {task_name} sample {index} ({method.name}) was made "
                                             f"from sample {made['sample']}, not {sample.id}: it cannot be resumed")  # fmt: skip
                        records.append(made)
                        if method.name == "fp16" and "tokens" in made:
                            answers[index] = made["tokens"]
                        continue
                    reference = None
                    if method.name == "fp16" or index in answers:
                        reference = Reference(answers.get(index), lambda: method.new_cache(model))
                    record, cache = task.run(model, tokenizer, sample, method.new_cache(model), prefill_chunk, reference)
                    if method.name == "fp16" and "tokens" in record:
                        answers[index] = record["tokens"]
                    record.update(cache_memory(cache))
                    del cache
                    record.update(
                        task=task_name,
                        method=method.name,
                        index=index,
                        sample=sample.id,
                        prompt_tokens=int(sample.input_ids.shape[1]),
                        prefill_chunk=prefill_chunk,
                        chunked_prefill=None if config is None or prefill_chunk is None else config.chunked_prefill,
                        ratios_source=None if config is None else config.ratios_source,
                        ratios=None if config is None else config.describe_ratios(),
                        **sample.meta,
                    )
                    records.append(record)
                    if on_record is not None:
                        on_record(record)
    return records


def _method_name(spec) -> str:
    """A method's canonical name (``kivi:2.0`` -> ``kivi:2``); a name no parser knows (an
    ablation variant) is kept as it is, so that writing results never fails on one."""
    if isinstance(spec, Method):
        return spec.name
    try:
        return parse_method(spec).name
    except ValueError:
        return str(spec)


def sort_records(records: list[dict], tasks=None, methods=None) -> list[dict]:
    """Records in task order, then method order (as the run listed them), then sample order."""
    tasks = {t: i for i, t in enumerate(tasks or dict.fromkeys(r["task"] for r in records))}
    methods = {_method_name(m): i for i, m in enumerate(methods or dict.fromkeys(r["method"] for r in records))}
    return sorted(records, key=lambda r: (tasks.get(r["task"], len(tasks)), methods.get(r["method"], len(methods)), r["index"]))


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def summarize(records: list[dict], by_length: bool = False) -> list[dict]:
    """One row per (task, method), or per (task, prompt length, method) with ``by_length``, in
    first-seen order; agreement is with the fp16 prediction."""
    reference = {(r["task"], r["index"]): r for r in records if r["method"] == "fp16"}
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["task"], r.get("length") if by_length else None, r["method"]), []).append(r)
    rows = []
    for (task, length, method), rs in groups.items():
        row = {
            "task": task,
            **({"length": length} if by_length else {}),
            "method": method,
            "metric": TASKS[task].metric,
            "higher_is_better": TASKS[task].higher_is_better,
            "samples": len(rs),
            "score": _mean(r["score"] for r in rs),
            "cache_bytes": _mean(r["cache_bytes"] for r in rs),
            "effective_bits": _mean(r["effective_bits"] for r in rs),
            "bavg": _mean(r["bavg"] for r in rs),
            "prefill_s": _mean(r["prefill_s"] for r in rs),
            "decode_tokens_per_s": _mean(r.get("decode_tokens_per_s") for r in rs),
            "ratios_source": rs[0]["ratios_source"],
            "ratios": rs[0]["ratios"],
        }
        if task == "squad":
            row["em"] = _mean(r["em"] for r in rs)
        # How far the method moves the uncompressed model's answer: the NLL of fp16's answer under it
        # against under fp16, sample by sample (continuous, where agreement flips with one token).
        answer_nll = [(r.get("answer_nll"), reference.get((task, r["index"]), {}).get("answer_nll")) for r in rs]
        if all(a is not None and ref is not None for a, ref in answer_nll):
            row["answer_nll_deviation_from_fp16"] = _mean(abs(a - ref) for a, ref in answer_nll)
        if task == "ppl":
            row["score"] = float(torch.tensor([r["nll"] for r in rs]).mean().exp())  # ppl of the pooled NLL
            # Fidelity to the uncompressed model, sample by sample: a perplexity below fp16's on one
            # sample and above on another averages out in the score, not here.
            fp16_nll = [reference.get((task, r["index"]), {}).get("nll") for r in rs]
            if None not in fp16_nll:
                row["nll_deviation_from_fp16"] = _mean(abs(r["nll"] - ref) for r, ref in zip(rs, fp16_nll))
        if all("found" in r for r in rs):  # RULER-style: the same expected strings found as fp16 found
            agree = [(r["found"], reference.get((task, r["index"]), {}).get("found")) for r in rs]
            if all(ref is not None for _, ref in agree):
                row["agreement_with_fp16"] = _mean(_mean(float(a == b) for a, b in zip(f, ref)) for f, ref in agree)
        else:
            agree = [(r["prediction"], reference.get((task, r["index"]), {}).get("prediction")) for r in rs if "prediction" in r]
            if agree and all(ref is not None for _, ref in agree):
                row["agreement_with_fp16"] = _mean(f1_score(p, ref) if task == "squad" else float(p == ref) for p, ref in agree)
        rows.append(row)
    return rows


BASELINES = ("kivi", "rkivi", "evict", "quanto")
"""Method families an HqeKV point is compared with at equal bytes."""


def baseline_at(points: list[tuple[float, float]], bits: float) -> float | None:
    """A baseline family's score at ``bits`` effective bits: linear between its points
    (bits, score); its largest point when ``bits`` is past it; None when every point of the
    family costs more (it cannot be run in that memory)."""
    points = sorted(points)
    if not points or bits < points[0][0]:
        return None
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= bits <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (bits - x0) / (x1 - x0)
    return points[-1][1]


def equal_bytes_comparison(rows: list[dict], families=("hqekv", "random")) -> list[dict]:
    """Each ``families`` point against every baseline family at its own effective bits.

    rows: :func:`summarize` rows (of one length, or pooled). -> one dict per (task, [length,]
    method, baseline): the method's score, the baseline's at the same bytes
    (:func:`baseline_at`; None if the baseline cannot be run that small) and ``wins``: the
    method's score is at least the baseline's (ties count, in the task's direction).
    """
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["task"], r.get("length")), []).append(r)
    for (task, length), rs in groups.items():
        for r in rs:
            if r["method"].split(":")[0] not in families:
                continue
            for family in BASELINES:
                points = [(b["effective_bits"], b["score"]) for b in rs if b["method"].split(":")[0] == family]
                if not points:
                    continue
                other = baseline_at(points, r["effective_bits"])
                better = other is None or (r["score"] >= other if r["higher_is_better"] else r["score"] <= other)
                out.append({
                    "task": task, **({"length": length} if length is not None else {}), "method": r["method"],
                    "baseline": family, "effective_bits": r["effective_bits"], "score": r["score"],
                    "baseline_score": other, "wins": better,
                })  # fmt: skip
    return out


def comparison_table(comparisons: list[dict]) -> str:
    """Markdown: each method against each baseline at equal bytes."""
    lines = [
        "| task | length | method | effective bits | score | baseline | baseline at these bytes | at least as good |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        other = "cannot fit" if c["baseline_score"] is None else f"{c['baseline_score']:.3f}"
        lines.append(
            f"| {c['task']} | {c.get('length', 'all')} | {c['method']} | {c['effective_bits']:.2f} | {c['score']:.3f} | "
            f"{c['baseline']} | {other} | {'yes' if c['wins'] else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def markdown_table(rows: list[dict]) -> str:
    """Markdown tables, one per task."""
    lines = []
    for task, length in dict.fromkeys((r["task"], r.get("length")) for r in rows):
        rs = [r for r in rows if r["task"] == task and r.get("length") == length]
        direction = "higher" if rs[0]["higher_is_better"] else "lower"
        at = "" if length is None else f" at {length} tokens"
        lines += [
            f"### {task}{at}: {rs[0]['metric']} ({direction} is better)",
            "",
            "| method | score | agreement with fp16 (ppl: mean abs ΔNLL) | fp16's answer: mean abs ΔNLL | cache MiB "
            "| effective bits | bavg | prefill s | decode tok/s | ratios |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rs:
            agree = r.get("agreement_with_fp16", r.get("nll_deviation_from_fp16"))
            answer = r.get("answer_nll_deviation_from_fp16")
            digits = 4 if task == "ppl" else 2
            tps = r["decode_tokens_per_s"]
            lines.append(
                f"| {r['method']} | {r['score']:.3f} | {'' if agree is None else f'{agree:.{digits}f}'} | "
                f"{'' if answer is None else f'{answer:.4f}'} | "
                f"{r['cache_bytes'] / 2**20:.2f} | {r['effective_bits']:.2f} | {r['bavg']:.2f} | "
                f"{r['prefill_s']:.2f} | {'' if tps is None else f'{tps:.1f}'} | {r['ratios_source'] or 'dense cache'} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot_cap(rows: list[dict]) -> float | None:
    """Where a plot of one task cuts its y axis: 2x fp16's score for lower-is-better scores, so
    that one collapsed method (quanto 2-bit perplexity > 100) does not flatten the rest; points
    above are drawn on the cut, labelled with their value. None: no cut."""
    ref = [r["score"] for r in rows if r["method"] == "fp16" and r["score"] is not None]
    return 2 * ref[0] if ref and not rows[0]["higher_is_better"] and ref[0] > 0 else None


def plot(rows: list[dict], path: Path) -> list[Path]:
    """One PNG per task: score vs effective bits per element, one line per method family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task, length in dict.fromkeys((r["task"], r.get("length")) for r in rows):
        rs = [r for r in rows if r["task"] == task and r.get("length") == length]
        fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=100)
        cap = plot_cap(rs)
        for family in dict.fromkeys(r["method"].split(":")[0] for r in rs):
            pts = sorted((r["effective_bits"], r["score"]) for r in rs if r["method"].split(":")[0] == family)
            if family == "fp16":  # a reference level: its bits would stretch the axis
                ax.axhline(pts[0][1], color="gray", linestyle="--", label=f"fp16 ({pts[0][0]:.0f} bits)")
                continue
            shown = [(x, y if cap is None else min(y, cap)) for x, y in pts]
            ax.plot([p[0] for p in shown], [p[1] for p in shown], marker="o", label=family)
            for (x, y), (_, true_y), r in zip(shown, pts, sorted((r for r in rs if r["method"].split(":")[0] == family),
                                                                key=lambda r: r["effective_bits"])):  # fmt: skip
                label = r["method"].split(":")[1] + ("" if y == true_y else f" (off scale: {true_y:.4g})")
                ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3 if y == true_y else -9), textcoords="offset points")
        if cap is not None:
            ax.set_ylim(top=cap * 1.03)
        ax.set_xlabel("effective bits per K/V element (real bytes)")
        ax.set_ylabel(rs[0]["metric"])
        at = "" if length is None else f", {length} tokens"
        ax.set_title(f"{task}{at} ({'higher' if rs[0]['higher_is_better'] else 'lower'} is better)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out = path / (f"{task}.png" if length is None else f"{task}-{length}.png")
        fig.savefig(out)
        plt.close(fig)
        written.append(out)
    return written


def write_results(records: list[dict], out: Path | str, settings: dict) -> dict:
    """results.json (settings, summary, every record), results.md and one plot per task in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records = sort_records(records, settings.get("tasks"), settings.get("methods"))
    rows = summarize(records)
    by_length = summarize(records, by_length=True)
    comparisons = equal_bytes_comparison(by_length)
    payload = {"version": RESULTS_VERSION, "settings": settings, "summary": rows, "summary_by_length": by_length,
               "equal_bytes": comparisons, "records": records}  # fmt: skip
    (out / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    header = f"# hqekv eval: {settings.get('model_id', '')}\n\n```\n{settings.get('command', '')}\n```\n\n"
    text = header + markdown_table(rows)
    if len({r.get("length") for r in records}) > 1:
        text += "\n## Per prompt length\n\n" + markdown_table(by_length)
        plot(by_length, out)
    if comparisons:
        text += "\n## At equal bytes (baselines interpolated linearly in effective bits)\n\n" + comparison_table(comparisons)
    (out / "results.md").write_text(text)
    plot(rows, out)
    return payload

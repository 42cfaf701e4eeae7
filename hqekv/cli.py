"""The ``hqekv`` command line: calibrate, eval, info, push."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .calibration import ALPHA, BETA, CALIBRATION_TOKENS, CONTINUATION_TOKENS, DEFAULT_SEGMENTS, DEFAULT_TRIALS, KL_SCALES
from .config import CHUNKED_PREFILL, describe_ratios
from .eval.runner import DEFAULT_METHODS, DEFAULT_TASKS


def _add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--model", required=required, help='Hub id or directory of a causal LM, or a packaged model: smollm2, qwen2.5-coder, gemma3 (hqekv.packaged_models)'
    )
    p.add_argument("--gguf-file", help="GGUF file inside --model to load")
    p.add_argument("--model-id", help="model id recorded in artifacts (default: --model, or the Hub id of a packaged model)")


def _add_settings_args(p: argparse.ArgumentParser) -> None:
    from .artifacts import MATCHED_SETTINGS
    from .config import DEFAULTS, EVICTION_CRITERIA

    g = p.add_argument_group("cache settings (HqeKVConfig)")
    for name in MATCHED_SETTINGS:
        flag = "--" + name.replace("_", "-")
        if name == "eviction":
            g.add_argument(flag, choices=EVICTION_CRITERIA, default=DEFAULTS[name])
        elif name == "value_group":  # by default as patch_model chooses it for the model's head dim
            g.add_argument(flag, type=int, help=f"default {DEFAULTS[name]}, or the largest power of two below it "
                           "that divides the head dim")  # fmt: skip
        else:
            g.add_argument(flag, type=int, default=DEFAULTS[name])


def settings_from_args(args) -> dict:
    """The cache settings an artifact is matched on (``MATCHED_SETTINGS``), from the arguments."""
    from .artifacts import MATCHED_SETTINGS

    return {n: getattr(args, n) for n in MATCHED_SETTINGS if getattr(args, n) is not None}


DTYPES = ("float32", "bfloat16", "float16")


def model_dtype(args):
    """The torch dtype ``--dtype`` names, or None for the checkpoint's own."""
    import torch

    return getattr(torch, args.dtype) if getattr(args, "dtype", None) else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hqekv", description="HqeKV KV-cache compression for Hugging Face causal LMs")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("calibrate", help="find tier ratios by TPE search and write one artifact per bavg, or measure "
                       "the model's layer profile (--profile)")  # fmt: skip
    _add_model_args(p)
    p.add_argument("--bavg", type=float, nargs="+", help="one or more bit budgets in (0, 16] (code bits per element)")
    p.add_argument(
        "--profile", action="store_true",
        help="measure the model's layer profile (minutes, not a search): the allocator (ratios='auto', the fallback) "
        "then gives each layer its own share of any budget. With --bavg, after the searches",
    )  # fmt: skip
    p.add_argument("--trials", type=int, default=DEFAULT_TRIALS, help="completed trials per bavg (default %(default)s)")
    p.add_argument(
        "--out", help="directory for artifacts and reports (default $HQEKV_CACHE/artifacts, ~/.cache/hqekv/artifacts: "
        "where patch_model finds them by itself)",
    )  # fmt: skip
    p.add_argument(
        "--storage",
        help="Optuna storage URL; default sqlite:///OUT/study.db (resumable). Any RDB URL lets workers share studies",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--context-tokens", type=int,
        help=f"context per segment (default {CALIBRATION_TOKENS} / segments - continuation, capped to the model's "
        "max_position_embeddings)",
    )  # fmt: skip
    p.add_argument("--segments", type=int, default=DEFAULT_SEGMENTS,
                   help="consecutive (context, continuation) segments of the calibration text (default %(default)s)")  # fmt: skip
    p.add_argument("--continuation-tokens", type=int, default=CONTINUATION_TOKENS)
    p.add_argument("--alpha", type=float, default=ALPHA, help="penalty on the 1-bit share δ3")
    p.add_argument("--beta", type=float, default=BETA, help="penalty on the evicted share δ4")
    p.add_argument(
        "--kl-scale", choices=KL_SCALES, default="log",
        help="data term: ln(KL) (default; α, β are tie-breakers) or the KL itself (the paper's scale)",
    )  # fmt: skip
    p.add_argument(
        "--rotation", choices=("none", "hadamard"), default="none",
        help="basis the search runs in (default none: its ratios measured better, and apply rotated too)",
    )  # fmt: skip
    p.add_argument(
        "--asymmetric", action="store_true",
        help="search key and value ratios apart under the one budget (default: one set for both, as the paper)",
    )  # fmt: skip
    p.add_argument(
        "--per-layer", action="store_true",
        help="after the search, split the budget over the layers by their measured sensitivity (not with --asymmetric)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true")
    _add_settings_args(p)

    p = sub.add_parser("split", help="per-layer budgets for the ratios of an existing artifact (no new search)")
    _add_model_args(p)
    p.add_argument("artifact", help="an artifact file of one set of ratios for --model")
    p.add_argument("--out", help="directory for the new artifact and its report (default: as calibrate's)")
    p.add_argument("--threads", type=int, help="torch CPU threads")

    p = sub.add_parser("eval", help="score KV-cache methods on tasks at equal memory: JSON, markdown table, plots")
    _add_model_args(p)
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   help="fp16, kivi:B, rkivi:B, evict:B, quanto:B, hqekv:B, rhqekv:B, calibrated:B, paper:B, rpaper:B, random:B, auto:B, shared:B, heads:B, fallback:B")  # fmt: skip
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), help="needle, squad, ppl, niah_multikey, niah_multivalue, vt, cwe, or ruler (the last four and squad)")
    p.add_argument("--samples", type=int, default=4, help="samples per task (default %(default)s)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="prompt lengths in tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-chunk", type=int, metavar="C",
                   help="feed each prompt in forwards of C tokens, as generate(prefill_chunk_size=C) does")  # fmt: skip
    p.add_argument("--chunked-prefill", choices=CHUNKED_PREFILL,
                   help="with --prefill-chunk: what every hqekv method's cache does while a prompt arrives in pieces "
                        "(patch_model's chunked_prefill; default wait)")  # fmt: skip
    p.add_argument("--out", required=True, help="directory for results.json, results.md and plots")
    p.add_argument(
        "--dtype", choices=DTYPES,
        help="dtype to load the model in (default: the checkpoint's; float32 for the packaged GGUF models)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--resume", action="store_true",
                   help="continue a run of the same command cut short: keep the records in OUT/records.partial.jsonl "
                        "and run only the others")  # fmt: skip

    p = sub.add_parser("info", help="what an artifact (file or directory) or a model holds")
    p.add_argument("paths", nargs="*", help="artifact files or directories")
    _add_model_args(p, required=False)
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("push", help="upload artifacts to a Hub model repo (created if needed) with a model card")
    p.add_argument("paths", nargs="+", help="artifact files")
    p.add_argument("--repo", required=True, help="Hub repo id, owner/name")
    p.add_argument("--private", action="store_true")
    p.add_argument("--token", help="Hub token (default: the logged-in one)")
    return parser


def calibration_storage(args) -> str:
    """The Optuna storage of `hqekv calibrate`: --storage, or SQLite in --out (resumable)."""
    return args.storage or f"sqlite:///{(Path(args.out) / 'study.db').resolve()}"


def run_calibration(args, model, tokenizer, model_id: str, *, write: bool = True, progress: bool = True, **workers):
    """`hqekv calibrate` on a loaded model: one result per --bavg; ``workers``: barrier, worker."""
    from .calibration import calibrate

    return calibrate(
        model,
        tokenizer,
        list(args.bavg),
        trials=args.trials,
        storage=calibration_storage(args),
        out=Path(args.out) if write else None,
        seed=args.seed,
        context_tokens=args.context_tokens,
        segments=args.segments,
        continuation_tokens=args.continuation_tokens,
        alpha=args.alpha,
        beta=args.beta,
        kl_scale=args.kl_scale,
        asymmetric=args.asymmetric,
        per_layer=args.per_layer,
        rotation=None if args.rotation == "none" else args.rotation,
        model_id=args.model_id or model_id,
        progress=progress and not args.no_progress,
        **workers,
        **settings_from_args(args),
    )


def print_calibration(results) -> None:
    for r in results:
        print(f"bavg={r.bavg:g}: {describe_ratios(r.ratios, r.key_ratios)}  best loss {r.best_loss:.5f} (KL {r.best_kl:.5f}), "
              f"{r.trials} trials -> {r.path}")


def _calibrate(args) -> int:
    import torch

    from .packaged_models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model, tokenizer, model_id = load_model(args.model, args.gguf_file)
    if args.bavg:
        print_calibration(run_calibration(args, model, tokenizer, model_id))
        print(f"study storage: {calibration_storage(args)}")
    if args.profile:
        from .calibration import measure_profile

        profile = measure_profile(
            model, tokenizer, out=Path(args.out), context_tokens=args.context_tokens, segments=args.segments,
            continuation_tokens=args.continuation_tokens, model_id=args.model_id or model_id,
            progress=not args.no_progress, **settings_from_args(args),
        )  # fmt: skip
        bits = ", ".join(f"{b:.2f}" for b in profile.layer_bits(2.0))
        print(f"layer profile: per-layer budgets at bavg 2: {bits} -> {profile.path}")
    return 0


def _split(args) -> int:
    import torch

    from .artifacts import check_fits, load_artifact
    from .calibration import split_artifact
    from .packaged_models import load_model, model_config

    if args.threads:
        torch.set_num_threads(args.threads)
    artifact = load_artifact(Path(args.artifact).expanduser())
    check_fits(artifact, model_config(args.model, args.gguf_file))  # before the weights load
    model, tokenizer, _ = load_model(args.model, args.gguf_file)
    result = split_artifact(model, tokenizer, artifact, out=Path(args.out))
    bits = ", ".join(f"{r.bavg:.2f}" for r in result.layer_ratios) if result.layer_ratios else "one set wins"
    print(f"bavg={result.bavg:g}: strength {result.metadata['layer_strength']:g}, KL {result.best_kl:.5f} "
          f"(one set: {result.metadata['layer_search'][0]['kl']:.5f}); per-layer bits {bits} -> {result.path}")  # fmt: skip
    return 0


PARTIAL_RECORDS = "records.partial.jsonl"
"""Where `hqekv eval` appends each record as it is made, in its --out directory, after a
first line with the run's settings; removed once results.json is written. A run cut short
leaves its finished records there, and ``--resume`` continues it."""
RESUMED_SETTINGS = ("model_id", "model_dtype", "methods", "tasks", "samples", "lengths", "seed", "prefill_chunk",
                    "chunked_prefill", "library_version")  # fmt: skip
"""What a resumed run must share with the run it continues: everything its records depend on."""


def read_partial(path: Path) -> tuple[dict, list[dict]]:
    """(settings, records) of a run cut short, from its :data:`PARTIAL_RECORDS` file; ValueError
    when the file does not start with the settings line (an older version, or not this file)."""
    text = [line for line in path.read_text().splitlines() if line.strip()]
    lines = []
    for number, line in enumerate(text, 1):
        try:
            lines.append(json.loads(line))
        except ValueError:
            if number < len(text):
                raise ValueError(f"{path}: line {number} is not a record, so the file cannot be resumed") from None
            # the last line of a run killed while writing it: that record is made again
    if not lines or set(lines[0]) != {"settings"}:
        raise ValueError(f"{path} does not start with the settings of its run, so it cannot be resumed")
    return lines[0]["settings"], lines[1:]


def resumable(path: Path, settings: dict) -> dict[tuple[str, str, int], dict]:
    """The records of ``path`` by (task, method, index), if its run had these ``settings``; else ValueError."""
    kept, records = read_partial(path)
    differ = [k for k in RESUMED_SETTINGS if kept.get(k) != settings.get(k)]
    if differ:
        said = "; ".join(f"{k}: {kept.get(k)!r} there, {settings.get(k)!r} here" for k in differ)
        raise ValueError(f"the records in {path} were made by another run ({said}): rerun its command "
                         f"({kept.get('command')}) with --resume, or remove the file to start over")  # fmt: skip
    return {(r["task"], r["method"], r["index"]): r for r in records}


def run_evaluation(
    args, model, tokenizer, *, shard: tuple[int, int] = (0, 1), progress: bool = True, on_record=None, done=None
) -> list[dict]:
    """`hqekv eval` on a loaded model: this shard's per-sample records (``done``: those already made)."""
    from .eval import evaluate

    return evaluate(
        model, tokenizer, args.methods, args.tasks, samples=args.samples, lengths=args.lengths, seed=args.seed,
        shard=shard, progress=progress and not args.no_progress, prefill_chunk=getattr(args, "prefill_chunk", None),
        chunked_prefill=getattr(args, "chunked_prefill", None), on_record=on_record, done=done,
    )  # fmt: skip


def _eval(args) -> int:
    import torch

    from .eval import write_results
    from .packaged_models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    partial = Path(args.out) / PARTIAL_RECORDS
    try:  # before the model loads
        if args.chunked_prefill and not args.prefill_chunk:
            raise ValueError("--chunked-prefill says what a cache does with a prompt fed in pieces: it needs "
                             "--prefill-chunk C")  # fmt: skip
        made = read_partial(partial)[1] if partial.exists() else []
        if made and not args.resume:
            raise ValueError(f"{partial} holds {len(made)} records of a run cut short: --resume continues it (the "
                             "same command), or remove the file to start over")  # fmt: skip
    except ValueError as err:
        print(f"hqekv eval: {err}", file=sys.stderr)
        return 2
    model, tokenizer, model_id = load_model(args.model, args.gguf_file, dtype=model_dtype(args))
    from .eval.runner import check_methods, check_request

    settings = eval_settings(args, args.model_id or model_id, model)
    try:  # before any sample runs: a method this model cannot take loses no finished work
        check_methods(model, check_request(args.methods, args.tasks, args.samples, args.lengths))
        done = resumable(partial, settings) if made else {}
    except ValueError as err:
        print(f"hqekv eval: {err}", file=sys.stderr)
        return 2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    # the settings, then the records kept (without a line a killed run left half written)
    lines = [{"settings": settings}, *done.values()]
    partial.write_text("".join(json.dumps(line, default=str) + "\n" for line in lines))
    with partial.open("a") as kept:

        def keep(record: dict) -> None:
            kept.write(json.dumps(record, default=str) + "\n")
            kept.flush()

        records = run_evaluation(args, model, tokenizer, on_record=keep, done=done)
    payload = write_results(records, args.out, settings)
    partial.unlink()
    print((Path(args.out) / "results.md").read_text())
    print(f"wrote {args.out}/results.json ({len(payload['records'])} records), results.md and plots")
    return 0


def eval_settings(args, model_id: str, model) -> dict:
    """What a results file records about the run."""
    from . import __version__

    argv = ["eval", "--model", args.model, *(["--gguf-file", args.gguf_file] if args.gguf_file else []),
            "--methods", *args.methods, "--tasks", *args.tasks, "--samples", str(args.samples),
            "--lengths", *map(str, args.lengths), "--seed", str(args.seed), "--out", str(args.out),
            *(["--prefill-chunk", str(args.prefill_chunk)] if getattr(args, "prefill_chunk", None) else []),
            *(["--chunked-prefill", args.chunked_prefill] if getattr(args, "chunked_prefill", None) else []),
            *(["--dtype", args.dtype] if getattr(args, "dtype", None) else [])]
    return {
        "model_id": model_id,
        "model_dtype": str(model.dtype),
        "methods": list(args.methods),
        "tasks": list(args.tasks),
        "samples": args.samples,
        "lengths": list(args.lengths),
        "seed": args.seed,
        "prefill_chunk": getattr(args, "prefill_chunk", None),
        "chunked_prefill": getattr(args, "chunked_prefill", None),
        "library_version": __version__,
        "command": "hqekv " + " ".join(argv),
    }


def _info(args) -> int:
    from .artifacts import PROFILE_SUFFIX, SUFFIX, fingerprint_fields, load_artifact, model_fingerprint, shipped_artifacts
    from .profiles import load_profile, shipped_profiles

    if not args.paths and not args.model:
        raise SystemExit("hqekv info: give artifact paths or --model")
    records = []
    for source in args.paths:
        path = Path(source)
        files = sorted(path.glob(f"*{SUFFIX}")) if path.is_dir() else [path]
        if path.is_dir() and not files:
            raise SystemExit(f"hqekv info: no {SUFFIX} artifacts in {path}")
        for f in files:
            if f.name.endswith(PROFILE_SUFFIX):
                p = load_profile(f)
                records.append(("profile", p.describe(), {"path": str(p.path), **p.metadata}))
                continue
            a = load_artifact(f)
            records.append(("artifact", a.describe(), {"path": str(a.path), "ratios": a.ratios.as_tuple(),
                                                       "superseded": a.superseded, **a.metadata}))  # fmt: skip
    if args.model:
        from .packaged_models import model_config
        from .patches import check_supported

        config = model_config(args.model, args.gguf_file)
        fingerprint = model_fingerprint(config)
        fitting = [a for a in map(load_artifact, shipped_artifacts()) if a.fingerprint == fingerprint]
        shipped = [a.path.name for a in fitting]
        superseded = [a.path.name for a in fitting if a.superseded]
        profiled = [p.path.name for p in shipped_profiles() if p.fingerprint == fingerprint]
        listed = [a.path.name + (" (superseded: the allocator runs at its bytes)" if a.superseded else "") for a in fitting]
        fields = fingerprint_fields(config)
        try:  # the model type and its attention features, as patch_model checks them
            check_supported(config.get_text_config())
            unsupported = None
        except ValueError as err:
            unsupported = str(err)
        supported = unsupported is None
        said = "True" if supported else f"False ({unsupported})"
        text = "\n".join(
            [f"{args.model}", f"  config fingerprint: {fingerprint}", f"  supported by hqekv: {said}"]
            + [f"  {k}: {v}" for k, v in fields.items()]
            + [f"  shipped artifacts: {', '.join(listed) or 'none'}"]
            + [f"  shipped layer profile: {', '.join(profiled) or 'none'}"]
        )
        records.append(("model", text, {"model": args.model, "config_fingerprint": fingerprint,
                                        "supported": supported, "unsupported_because": unsupported, **fields,
                                        "shipped_artifacts": shipped, "superseded_artifacts": superseded,
                                        "shipped_profiles": profiled}))  # fmt: skip
    if args.json:
        print(json.dumps([r[2] for r in records], indent=1))
    else:
        print("\n".join(r[1] for r in records))
    return 0


def _push(args) -> int:
    from .artifacts import PROFILE_SUFFIX, push_artifacts
    from .profiles import load_profile

    profiles = [load_profile(p) for p in args.paths if str(p).endswith(PROFILE_SUFFIX)]
    ratios = [p for p in args.paths if not str(p).endswith(PROFILE_SUFFIX)]
    extra = [(p.path, f"Layer profile of `{p.metadata['model_id']}`: `patch_model` splits the allocator's budget over "
              "the layers by it. Per-layer budgets at bavg 2: " + ", ".join(f"{b:.2f}" for b in p.layer_bits(2.0)))
             for p in profiles]  # fmt: skip
    url = push_artifacts(ratios, args.repo, token=args.token, private=args.private, extra=extra)
    print(f"pushed {len(args.paths)} artifact(s) to {url}")
    return 0


def check_args(args) -> None:
    """Everything about the arguments that can be wrong, before a model loads (``ValueError``)."""
    import math

    from .config import FP16_RATIOS, HqeKVConfig, check_bavg

    def positive(name: str, value, allow_none: bool = False) -> None:
        if value is None and allow_none:
            return
        if value is None or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")

    if getattr(args, "threads", None) is not None:
        positive("threads", args.threads)
    if args.command == "calibrate":
        if not args.bavg and not args.profile:
            raise ValueError("give --bavg (a search per budget), --profile (the layer profile), or both")
        for b in args.bavg or ():
            check_bavg(b)
        for name in ("trials", "segments", "continuation_tokens"):
            positive(name, getattr(args, name))
        positive("context_tokens", args.context_tokens, allow_none=True)
        for name in ("alpha", "beta"):
            value = getattr(args, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"--{name} must be a finite number >= 0, got {value}")
        HqeKVConfig(ratios=FP16_RATIOS, bavg=16.0, **settings_from_args(args))  # validates the cache settings
        if args.per_layer and args.asymmetric:
            raise ValueError("--per-layer and --asymmetric cannot be combined: per-layer budgets hold for keys and values alike")
    elif args.command == "split":
        from .artifacts import check_splittable, load_artifact

        path = Path(args.artifact).expanduser()
        if path.is_dir():
            raise ValueError(f"{args.artifact} is a directory: give one artifact file of it (`hqekv info {args.artifact}` "
                             "lists them)")  # fmt: skip
        check_splittable(load_artifact(path))  # a missing, corrupt or split file fails here, not after the model loads
    elif args.command == "eval":
        from .eval.runner import check_request
        from .eval.tasks import expand_tasks

        check_request(args.methods, args.tasks, args.samples, args.lengths)
        args.tasks = expand_tasks(args.tasks)  # "ruler" recorded as the tasks it ran
    if getattr(args, "model", None):
        from .packaged_models import PACKAGED

        if args.model in PACKAGED and getattr(args, "gguf_file", None):
            raise ValueError(f"--gguf-file does not apply to the packaged model {args.model!r}: it is one GGUF file already")

        # a Hub id is name or owner/name; a path-like name that does not exist cannot load
        local = args.model.startswith((".", "/", "~")) or args.model.count("/") > 1
        if args.model not in PACKAGED and local and not Path(args.model).expanduser().exists():
            raise ValueError(f"--model {args.model}: no such directory (nor a packaged model: {', '.join(PACKAGED)})")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .artifacts import ArtifactError

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.command in ("calibrate", "split") and args.out is None:
        from .user_cache import artifacts_dir

        args.out = str(artifacts_dir())  # where patch_model finds them by itself
    try:
        check_args(args)
    except (TypeError, ValueError) as err:
        print(f"hqekv {args.command}: {err}", file=sys.stderr)
        return 2
    try:
        return {"calibrate": _calibrate, "split": _split, "eval": _eval, "info": _info, "push": _push}[args.command](args)
    except ArtifactError as err:
        print(f"hqekv {args.command}: {err}", file=sys.stderr)
        return 2
    except (OSError, ModuleNotFoundError) as err:  # a model or repo that cannot be read or reached, offline
        print(f"hqekv {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

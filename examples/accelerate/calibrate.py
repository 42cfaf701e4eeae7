"""Calibration workers sharing one Optuna study: one process per device, rank 0 writes artifacts.

    accelerate launch --num_processes N examples/accelerate/calibrate.py --model smollm2 \
        --bavg 2 3.2 --trials 200 --storage postgresql://user@host/hqekv --out artifacts/
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate/calibrate.py ...   # no GPU: 2 CPU workers

Every process prefills the calibration context on its own device, then runs trials of the
same study (its sampler seeded with seed + rank) until the study holds --trials completed
trials. SQLite works for a few processes on one machine; use a server database (PostgreSQL,
MySQL) for many. Takes the arguments of `hqekv calibrate`.

On a machine without GPUs, ``--multi_gpu`` starts CPU workers that talk over gloo (``--cpu``
alone starts a single process unless MPI is set up).
"""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402

from hqekv.calibration import calibrate  # noqa: E402
from hqekv.cli import build_parser, settings_from_args  # noqa: E402
from hqekv.models import load_model  # noqa: E402


def main():
    args = build_parser().parse_args(["calibrate", *os.sys.argv[1:]])
    state = PartialState(cpu=not torch.cuda.is_available())  # CPU workers talk over gloo
    out = Path(args.out)
    storage = args.storage or f"sqlite:///{(out / 'study.db').resolve()}"
    if state.is_main_process:
        import optuna

        out.mkdir(parents=True, exist_ok=True)
        optuna.storages.get_storage(storage)  # creates the schema once, before the workers race for it
    state.wait_for_everyone()
    model, tokenizer, model_id = load_model(args.model, args.gguf_file)
    model.to(state.device)
    results = calibrate(
        model,
        tokenizer,
        list(args.bavg),
        trials=args.trials,
        storage=storage,
        out=out if state.is_main_process else None,
        seed=args.seed,
        context_tokens=args.context_tokens,
        continuation_tokens=args.continuation_tokens,
        alpha=args.alpha,
        beta=args.beta,
        model_id=args.model_id or model_id,
        progress=state.is_main_process and not args.no_progress,
        barrier=state.wait_for_everyone,
        worker=state.process_index,
        **settings_from_args(args),
    )
    if state.is_main_process:
        for r in results:
            print(f"bavg={r.bavg:g}: {r.ratios.describe()}  best loss {r.best_loss:.5f}, {r.trials} trials -> {r.path}")


if __name__ == "__main__":
    main()

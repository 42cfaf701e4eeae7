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

from pathlib import Path

from workers import start_worker

from hqekv.cli import calibration_storage, print_calibration, run_calibration


def main():
    args, state, model, tokenizer, model_id = start_worker("calibrate")
    if state.is_main_process:
        import optuna

        Path(args.out).mkdir(parents=True, exist_ok=True)
        optuna.storages.get_storage(calibration_storage(args))  # the schema once, before the workers race for it
    state.wait_for_everyone()
    results = run_calibration(
        args, model, tokenizer, model_id, write=state.is_main_process, progress=state.is_main_process,
        barrier=state.wait_for_everyone, worker=state.process_index,
    )
    if state.is_main_process:
        print_calibration(results)


if __name__ == "__main__":
    main()

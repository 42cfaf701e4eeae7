"""Data-parallel `hqekv eval`: each process runs a share of the samples, rank 0 writes one result.

    accelerate launch --num_processes N examples/accelerate/eval.py --model smollm2 \
        --methods fp16 kivi:2 hqekv:2 --tasks needle squad ppl --samples 8 --out results/RUN
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate/eval.py ...   # no GPU: 2 CPU workers

Samples are generated from the seed identically in every process and split round-robin,
so the merged records are those of a one-process run (timings aside).

On a machine without GPUs, ``--multi_gpu`` starts CPU workers that talk over gloo (``--cpu``
alone starts a single process unless MPI is set up).
"""

from workers import start_worker  # first: it sets HF_HUB_OFFLINE before the Hub client loads

from accelerate.utils import gather_object

from hqekv.cli import eval_settings, run_evaluation
from hqekv.eval import write_results


def main():
    args, state, model, tokenizer, model_id = start_worker("eval")
    records = run_evaluation(
        args, model, tokenizer, shard=(state.process_index, state.num_processes), progress=state.is_main_process
    )
    merged = gather_object(records)
    if state.is_main_process:
        settings = eval_settings(args, args.model_id or model_id, model)
        settings["processes"] = state.num_processes
        write_results(merged, args.out, settings)
        print(f"{state.num_processes} processes: {len(merged)} records -> {args.out}")
    state.wait_for_everyone()


if __name__ == "__main__":
    main()

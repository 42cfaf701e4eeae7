"""Data-parallel `hqekv eval`: each process runs a share of the samples, rank 0 writes one result.

    accelerate launch --num_processes N examples/accelerate/eval.py --model smollm2 \
        --methods fp16 kivi:2 hqekv:2 --tasks needle squad ppl --samples 8 --out results/RUN
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate/eval.py ...   # no GPU: 2 CPU workers

Samples are generated from the seed identically in every process and split round-robin,
so the merged records are those of a one-process run (timings aside).

On a machine without GPUs, ``--multi_gpu`` starts CPU workers that talk over gloo (``--cpu``
alone starts a single process unless MPI is set up).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
from accelerate.utils import gather_object  # noqa: E402

from hqekv.cli import build_parser, eval_settings  # noqa: E402
from hqekv.eval import evaluate, parse_method, write_results  # noqa: E402
from hqekv.models import load_model  # noqa: E402


def main():
    args = build_parser().parse_args(["eval", *os.sys.argv[1:]])
    state = PartialState(cpu=not torch.cuda.is_available())  # CPU workers talk over gloo
    methods = [parse_method(m) for m in args.methods]
    model, tokenizer, model_id = load_model(args.model, args.gguf_file)
    model.to(state.device)
    records = evaluate(
        model, tokenizer, methods, args.tasks, samples=args.samples, lengths=args.lengths, seed=args.seed,
        shard=(state.process_index, state.num_processes), progress=state.is_main_process and not args.no_progress,
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

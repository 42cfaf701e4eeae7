"""What both launchers do first: parse the `hqekv` command's arguments, join, load the model."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402

from hqekv.cli import build_parser, model_dtype  # noqa: E402
from hqekv.packaged_models import load_model  # noqa: E402


def start_worker(command: str):
    """(args of `hqekv COMMAND`, accelerate state, model on this process's device, tokenizer, model id).

    Without a GPU the workers are CPU processes talking over gloo.
    """
    args = build_parser().parse_args([command, *sys.argv[1:]])
    if getattr(args, "resume", False):  # before the model loads
        raise SystemExit(f"--resume continues `hqekv {command}` runs; the accelerate launchers keep no partial records")
    state = PartialState(cpu=not torch.cuda.is_available())
    model, tokenizer, model_id = load_model(args.model, args.gguf_file, dtype=model_dtype(args))
    model.to(state.device)
    return args, state, model, tokenizer, model_id

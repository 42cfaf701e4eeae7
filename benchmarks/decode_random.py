"""Decode tokens/s through ``model.generate`` on a random-weight model of a real shape.

    python benchmarks/decode_random.py --shape llama3-8b --lengths 8192 32768 --dtype bfloat16 \
        --out benchmarks/results/gpu_decode.json          # on one CUDA GPU (gpu_check.sh)
    python benchmarks/decode_random.py --shape tiny --lengths 512 --dtype float32  # CPU smoke

For a machine without the real weights: a Llama model of the given shape is initialised at
random in the given dtype, on CUDA when there is one. Each length runs the unpatched model
(``DynamicCache``, eager), then hqekv at each bavg (uncalibrated ratios: the shape has no
artifact), eager and with ``generate``'s compiled decode step (``compile_config``: on CUDA
mode "reduce-overhead", i.e. CUDA graphs where the graph allows them). Speed is timed per
step as in ``decode.py``; the prompt is random token ids, so the tokens say nothing.
"""

import argparse

import torch
from common import save
from decode import generate, measure
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096),
}  # fmt: skip


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--bavg", type=float, nargs="+", default=[2.0, 3.2])
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode_random-SHAPE.json)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialised in the dtype: 8B parameters never exist in fp32 (32 GB)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**SHAPES[args.shape])).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    print(f"model ready: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, {model.dtype}", flush=True)
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(device) for n in args.lengths}
    warm = torch.randint(0, model.config.vocab_size, (1, 256), generator=gen).to(device)
    generate(model, warm, 4)  # warm-up
    rows, compile_s = measure(model, prompts, warm, args.bavg, args.new_tokens, not args.no_compile)
    payload = {"shape": args.shape, "config": SHAPES[args.shape], "device": device,
               "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": args.dtype,
               "weights": "random", "measured_through": "model.generate (greedy), eager and compile_config",
               "compile_seconds": compile_s, "rows": rows}  # fmt: skip
    save(f"decode_random-{args.shape}", payload, args.out)


if __name__ == "__main__":
    main()

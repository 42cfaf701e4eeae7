"""What a static cache (``max_length`` set: CUDA graphs) reserves beyond what its chunks use.

    python benchmarks/static_room.py [--length 4096] [--new 256] [--bavg 2 3.2] [--growth 1.25 2]

SmolLM2 with its shipped ratios, a prompt of ``--length`` essay tokens, greedy ``generate``
of ``--new`` tokens, eager, fp32: once over a cache without ``max_length`` (storage exactly
what the chunks need) and once over a static cache sized for the whole request, per growth
factor (``hqekv.cache.rows.GROWTH``). Recorded per run: the reserve's share of the cache after the
prefill and at the end, the static cache's bytes against the exact one's, how many times a
decode step found its storage moved (each is a CUDA graph re-recording), and that both gave
the same tokens. Writes ``results/static_room.json``.
"""

import argparse
import warnings

from common import essay_ids, load_smollm2, save

import torch
from transformers import LogitsProcessor, LogitsProcessorList

import hqekv
import hqekv.cache.rows


def decode_addresses(cache) -> tuple[int, ...]:
    """The addresses of every tensor a decode step of ``cache`` uses."""
    return tuple(t.data_ptr() for layer in cache.layers for t in layer.decode_tensors())


class Moves(LogitsProcessor):
    """Counts the decode steps before which some decode tensor of ``cache`` changed address."""

    def __init__(self, cache):
        self.cache, self.last, self.moves, self.after_prefill = cache, None, 0, None

    def __call__(self, input_ids, scores):
        now = decode_addresses(self.cache)
        if self.last is None:
            self.after_prefill = self.cache.memory_report()
        elif now != self.last:
            self.moves += 1
        self.last = now
        return scores


def run(model, ids, new: int, max_length: int | None):
    cache = hqekv.new_cache(model, max_length)
    moves = Moves(cache)
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             logits_processor=LogitsProcessorList([moves]))  # fmt: skip
    return out, cache.memory_report(), moves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--bavg", type=float, nargs="+", default=[2.0, 3.2])
    parser.add_argument("--growth", type=float, nargs="+", default=[1.25, 2.0])
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    model, tokenizer = load_smollm2()
    ids = essay_ids(tokenizer, args.length)
    rows = []
    for bavg in args.bavg:
        hqekv.patch_model(model, bavg=bavg)
        exact_out, exact, _ = run(model, ids, args.new, None)
        for growth in args.growth:
            hqekv.cache.rows.GROWTH = growth
            out, report, moves = run(model, ids, args.new, args.length + args.new - 1)
            row = {
                "bavg": bavg,
                "growth": growth,
                "prompt": args.length,
                "new_tokens": args.new,
                "reserve_share_after_prefill": (
                    moves.after_prefill.bytes_by_part["reserve"] / moves.after_prefill.total_bytes
                ),
                "reserve_share_at_end": report.bytes_by_part["reserve"] / report.total_bytes,
                "static_over_exact_bytes": report.total_bytes / exact.total_bytes,
                "effective_bits_exact": exact.effective_bits,
                "effective_bits_static": report.effective_bits,
                "steps_with_moved_storage": moves.moves,
                "same_tokens": bool(torch.equal(out, exact_out)),
            }
            rows.append(row)
            print(
                f"bavg {bavg:g} growth {growth:g}: reserve {row['reserve_share_after_prefill']:.1%} after the prefill, "
                f"{row['reserve_share_at_end']:.1%} at the end; {row['static_over_exact_bytes']:.3f}x the exact "
                f"cache's bytes ({row['effective_bits_static']:.2f} vs {row['effective_bits_exact']:.2f} bits); "
                f"storage moved before {moves.moves} of {args.new - 1} decode steps; same tokens: {row['same_tokens']}"
            )
        hqekv.unpatch_model(model)
    save("static_room", {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "rows": rows})


if __name__ == "__main__":
    main()

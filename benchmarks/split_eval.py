"""``hqekv eval`` with the allocator's layers at budgets split by measured sensitivities.

    python benchmarks/split_eval.py SENSITIVITY [--strength 0.5] eval --model M --methods fp16 auto:2.6 ...

Every ``auto:B`` method of the run patches with ``layer_bits`` split from SENSITIVITY (a JSON
list, or an artifact's report or ``.safetensors`` file holding ``layer_sensitivity``, as
``benchmarks/allocation.py --split`` reads it) by :func:`hqekv.allocation.split_budget` at
``--strength``: each layer its own budget, no budget shared between layers. The other methods
run as ``hqekv eval`` runs them. Docs: docs/results.md, "Layers at budgets split by their
measured sensitivity".
"""

import argparse
import sys

from allocation import load_sensitivity

import hqekv
from hqekv.allocation import split_budget
from hqekv.cli import main as cli
from hqekv.eval.methods import Method


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sensitivity")
    parser.add_argument("--strength", type=float, default=hqekv.allocation.LAYER_STRENGTH)
    args, rest = parser.parse_known_args()
    sensitivity = load_sensitivity(args.sensitivity)
    plain = Method.patch_kwargs

    def patch_kwargs(self):
        kwargs = plain(self)
        if self.kind == "auto":
            kwargs = {**kwargs, "layer_bits": split_budget(self.bits, sensitivity, args.strength)}
        return kwargs

    Method.patch_kwargs = patch_kwargs
    return cli(rest)


if __name__ == "__main__":
    sys.exit(main())

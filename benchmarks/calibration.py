"""Wall time of the ratio search on SmolLM2: prepared objective vs a full prefill per trial.

    python benchmarks/calibration.py [--context-tokens 16384] [--trials 20] [--reference-trials 1]

Times the one-off preparation (FP16 prefill of the calibration context, importance, every
tier's dequantized chunks), ``--trials`` trials of the prepared objective, and
``--reference-trials`` trials the way the reference code runs them (a compressed prefill of
the whole context per trial). Both are extrapolated to 200 trials; the same process runs
both. The shipped artifacts' reports hold the measured time of their 200-trial studies.
"""

import argparse
import json
import time
import warnings

from common import load_smollm2, save

import torch
from hqekv.artifacts import report_path, shipped_artifacts
from hqekv.calibration import CONTINUATION_TOKENS, CompressionObjective, ratios_from_free, reference_style_kl
from hqekv.texts import calibration_text


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--context-tokens", type=int, default=16384)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--reference-trials", type=int, default=1)
    parser.add_argument("--bavg", type=float, default=3.2)
    args = parser.parse_args()
    if args.trials < 1 or args.reference_trials < 1:
        parser.error("--trials and --reference-trials must be at least 1 (the speed-up compares the two)")
    warnings.simplefilter("ignore")
    model, tok = load_smollm2()
    text = calibration_text(tok, args.context_tokens, CONTINUATION_TOKENS)

    start = time.perf_counter()
    objective = CompressionObjective(model, text.context, text.continuation)
    setup_s = time.perf_counter() - start

    g = torch.Generator().manual_seed(0)
    samples = []
    while len(samples) < args.trials:
        x3, x4 = (torch.rand(2, generator=g) * 0.3).tolist()
        ratios = ratios_from_free(args.bavg, x3, x4)
        if ratios is not None:
            samples.append(ratios)
    start = time.perf_counter()
    kls = [objective.kl(r) for r in samples]
    trial_s = (time.perf_counter() - start) / len(samples)

    reference = []
    for r, kl in list(zip(samples, kls))[: args.reference_trials]:
        start = time.perf_counter()
        full = reference_style_kl(model, text.context, text.continuation, r)
        # reference_style_kl runs the FP16 and the compressed pass; a reference trial is one pass
        reference.append({"seconds": (time.perf_counter() - start) / 2, "kl": full, "prepared_kl": kl})
    reference_s = sum(r["seconds"] for r in reference) / len(reference)

    fast_200 = setup_s + 200 * trial_s
    slow_200 = 200 * reference_s
    shipped = {}
    for path in shipped_artifacts():
        report = json.loads(report_path(path).read_text())
        shipped[path.name] = {k: report["metadata"].get(k) for k in ("trials", "setup_seconds", "study_seconds")}
    payload = {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1)",
        "context_tokens": args.context_tokens,
        "continuation_tokens": CONTINUATION_TOKENS,
        "bavg": args.bavg,
        "setup_s": setup_s,
        "prepared_trial_s": trial_s,
        "reference_trial_s": reference_s,
        "reference_trials": reference,
        "prepared_200_trials_s": fast_200,
        "reference_200_trials_s": slow_200,
        "speedup": slow_200 / fast_200,
        "shipped_studies": shipped,
    }
    print(
        f"{args.context_tokens} tokens: setup {setup_s:.0f}s, {trial_s:.2f}s/trial prepared vs "
        f"{reference_s:.0f}s/trial with a full prefill -> 200 trials {fast_200 / 60:.1f} min vs "
        f"{slow_200 / 60:.0f} min ({payload['speedup']:.0f}x)"
    )
    save("calibration", payload)


if __name__ == "__main__":
    main()

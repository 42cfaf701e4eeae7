"""The rate-distortion allocator (``ratios="auto"``) against shares, on development text.

    python benchmarks/allocation.py [--model smollm2] [--context 2048] [--segments 2]
                                    [--methods hqekv:2 fallback:2 auto:2.5] [--out NAME]

Text: the calibration articles (the first SQuAD v2 dev articles, ``hqekv.texts.calibration_text``),
which the evaluation never reads, so that designing the allocator here does not tune it to
the evaluation's tasks. Each segment's context is prefilled through the method's cache, then
its 128-token continuation goes in 32-token forwards (the cache re-ranks between them), and
the continuation's next-token distributions are compared with the uncompressed model's:
mean KL and mean per-segment |ΔNLL|, with the cache's real bytes (effective bits per element)
and the tier counts it ended with. Methods as ``hqekv eval`` names them.

``--layer-weight residual`` (or ``residual-sqrt``) is an ablation of how the allocator shares
the model's budget between layers (``hqekv.allocation.share``): each layer's distortions,
relative to its window output energy, are further weighed by ρ (or √ρ), where ρ is what the
layer's attention adds to the residual stream against the stream itself, ‖a‖² / ‖h‖² over the
window's last 20 tokens (hooks on the decoder layers of a Llama-style model: ``a`` is
``self_attn``'s output). An output error then counts by how far it moves the stream it is
added to. Tried, not kept: docs/results.md, "Layers weighed by what their attention adds".
"""

import argparse
import contextlib
import dataclasses
import time
import warnings

import torch
from common import save

import hqekv
from hqekv.texts import calibration_text
from hqekv.eval.methods import parse_method
from hqekv.packaged_models import load_model


def continuation_logprobs(model, context, continuation, step=32):
    """Log-probabilities (L, V) the model gives each continuation token's position, and the cache."""
    out = model(context, use_cache=True, logits_to_keep=1)
    cache = hqekv.patching.output_cache(out)
    rows = [out.logits[0, -1:].float().log_softmax(-1)]
    for i in range(0, continuation.shape[1], step):
        logits = model(continuation[:, i : i + step], cache=cache, use_cache=True).logits[0]
        rows.append(logits.float().log_softmax(-1))
    return torch.cat(rows)[: continuation.shape[1]], cache


@contextlib.contextmanager
def residual_layer_weight(model, power: float):
    """Share the budget with each layer's distortions weighed by ρ**power (module docstring)."""
    from hqekv import allocation
    from hqekv.cache.model_cache import HqeKVCache
    from hqekv.config import HqeKVConfig

    window = HqeKVConfig.window  # the window queries' count the importance reads
    stream, rho, order = {}, {}, []

    def before(i):
        def hook(module, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            stream[i] = h[:, -window:].float().pow(2).sum((-1, -2))
        return hook

    def after(i):
        def hook(module, args, out):
            a = out[0] if isinstance(out, tuple) else out
            rho[i] = a[:, -window:].float().pow(2).sum((-1, -2)) / stream[i].clamp(min=1e-30)
        return hook

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_pre_hook(before(i), with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(after(i)))
    share, share_budget = allocation.share, HqeKVCache.share_budget

    def weighed_share(layers, bytes_k, bytes_v, floor=None):
        if len(layers) == len(order) > 1:  # the model's budget, not one layer's own
            layers = [dataclasses.replace(x, energy=x.energy / r.to(x.energy).clamp(min=1e-12) ** power)
                      for x, r in zip(layers, order)]  # fmt: skip
        return share(layers, bytes_k, bytes_v, floor)

    def ordered_share_budget(cache):
        order[:] = [rho[x.layer_idx] for x in cache.hqekv_layers if x.is_initialized and x.pending is not None]
        try:
            share_budget(cache)
        finally:
            order.clear()

    allocation.share, HqeKVCache.share_budget = weighed_share, ordered_share_budget
    try:
        yield
    finally:
        allocation.share, HqeKVCache.share_budget = share, share_budget
        for h in handles:
            h.remove()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--segments", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["hqekv:2", "fallback:2", "auto:2", "auto:2.5"])
    parser.add_argument("--out", default="allocation")
    parser.add_argument("--layer-weight", choices=["energy", "residual", "residual-sqrt"], default="energy",
                        help="how the shared budget weighs each layer (an ablation; module docstring)")
    args = parser.parse_args()
    model, tokenizer, _ = load_model(args.model)
    text = calibration_text(tokenizer, args.context, 128, args.segments)
    reference = []
    with torch.no_grad():
        for s in range(args.segments):
            ids = text.context[s : s + 1]
            reference.append(continuation_logprobs(model, ids, text.continuation[s : s + 1])[0])
    rows = {}
    defaults = hqekv.allocation.ERROR_MODEL, hqekv.allocation.LAYER_SCALE
    power = {"energy": None, "residual": 1.0, "residual-sqrt": 0.5}[args.layer_weight]
    for spec in args.methods:
        spec, _, variant = spec.partition("@")  # auto:2@retrieval,none: error model, layer scale
        if variant:
            model_name, _, scale = variant.partition(",")
            hqekv.allocation.ERROR_MODEL = model_name
            hqekv.allocation.LAYER_SCALE = scale or "energy"
        method = parse_method(spec)
        kl, dnll, bits, seconds, chunks = [], [], [], [], {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            weight = residual_layer_weight(model, power) if power else contextlib.nullcontext()
            with weight, method.applied(model) as config, torch.no_grad():
                for s in range(args.segments):
                    start = time.perf_counter()
                    logp, cache = continuation_logprobs(model, text.context[s : s + 1], text.continuation[s : s + 1])
                    seconds.append(time.perf_counter() - start)
                    ref = reference[s]
                    target = text.continuation[s]
                    kl.append(float((ref.exp() * (ref - logp)).sum(-1).mean()))
                    nll = -logp.gather(1, target[:, None]).mean()
                    ref_nll = -ref.gather(1, target[:, None]).mean()
                    dnll.append(float((nll - ref_nll).abs()))
                    report = cache.memory_report()
                    bits.append(report.effective_bits)
                    for k, v in report.chunks.items():
                        chunks[k] = chunks.get(k, 0) + v
        hqekv.allocation.ERROR_MODEL, hqekv.allocation.LAYER_SCALE = defaults
        spec = spec + (f"@{variant}" if variant else "")
        rows[spec] = {"kl": sum(kl) / len(kl), "abs_dnll": sum(dnll) / len(dnll), "effective_bits": sum(bits) / len(bits),
                      "seconds": sum(seconds) / len(seconds), "chunks": chunks,
                      "source": config.ratios_source if config else "dense"}  # fmt: skip
        r = rows[spec]
        print(f"{spec:>14}: KL {r['kl']:.4f}  |dNLL| {r['abs_dnll']:.4f}  bits {r['effective_bits']:.2f}  "
              f"{r['seconds']:.1f}s  {chunks}", flush=True)  # fmt: skip
    save(args.out, {"model": args.model, "text": "calibration articles (development)", "context": args.context,
                    "segments": args.segments, "layer_weight": args.layer_weight, "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()

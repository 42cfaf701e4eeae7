"""The rate-distortion allocator (``ratios="auto"``) against shares, on development text.

    python benchmarks/allocation.py [--model smollm2] [--context 2048] [--segments 2]
                                    [--methods hqekv:2 fallback:2 auto:2.5] [--out NAME]
                                    [--split SENSITIVITY [--strength 0.5]] [--measure-sensitivity FILE --bits 1]

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

``--split SENSITIVITY`` runs the ``auto:B`` methods with each layer at its own budget
(``patch_model(..., ratios="auto", layer_bits=...)``), split from per-layer sensitivities
(:func:`hqekv.allocation.split_budget` at ``--strength``): a JSON list, or an artifact's
report or ``.safetensors`` file holding ``layer_sensitivity``. ``--measure-sensitivity FILE``
measures them with the allocator itself and writes that list: for each layer, the mean KL
with that layer alone at ``auto:--bits`` and every other layer at 16 bits (full precision),
on the segments after the ones scored (``--segments`` more), so that a split measured here
is scored on text it did not read. Docs: docs/results.md, "Layers at budgets split by their
measured sensitivity".

``--heldout SEED`` scores on held-out text instead, to check a design made here: the SQuAD
articles the calibration never reads (those after ``hqekv.eval.tasks.CALIBRATION_ARTICLES``,
the ppl task's pool) in an order shuffled by SEED, or with ``--heldout-text essays`` the Paul
Graham essays from an offset drawn by SEED (the needle tasks' haystack, another kind of
text); mean KL is then a far less noisy measure of closeness to fp16 than the ppl task's
|ΔNLL| of a mean NLL, in which errors of opposite sign cancel.

``--head-eviction head`` runs the ``heads:B`` methods (tiers per KV head, ``head_tiers=True``)
with each KV head's part of a chunk evicted apart, where by default
(:data:`hqekv.allocation.HEAD_EVICTION` "chunk") a chunk is evicted for all its heads or
none. Docs: docs/results.md, "Tiers per KV head".

``--layer-weight fisher`` (or ``fisher-sqrt``) shares the budget with each layer's
distortions weighed by the mean Fisher information of its attention output (the input of
``o_proj``), measured once by a backward pass on the segment after the scored ones with
labels drawn from the model itself, instead of their window output energy (or by √F /
√energy). Tried, not kept (docs/results.md).
"""

import argparse
import json
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


def heldout_text(tokenizer, context: int, segments: int, seed: int, kind: str = "squad"):
    """``segments`` (context, 128-token continuation) pairs of text no design here read (module docstring)."""
    import random

    from hqekv import texts
    from hqekv.eval.tasks import CALIBRATION_ARTICLES

    n = segments * (context + 128)
    rng = random.Random(seed)
    if kind == "essays":
        text = texts.essays()
        offset = rng.randint(0, len(text) // 2)
        ids = tokenizer(text[offset : offset + 8 * n], add_special_tokens=False)["input_ids"][:n]
    else:
        articles = list(texts.squad_articles()[CALIBRATION_ARTICLES:])
        rng.shuffle(articles)
        ids, _ = texts.joined_tokens(tokenizer, articles, n)
    ids = torch.tensor(ids).reshape(segments, context + 128)
    return argparse.Namespace(context=ids[:, :context], continuation=ids[:, context:])


def continuation_logprobs(model, context, continuation, step=32):
    """Log-probabilities (L, V) the model gives each continuation token's position, and the cache."""
    out = model(context, use_cache=True, logits_to_keep=1)
    cache = hqekv.patching.output_cache(out)
    rows = [out.logits[0, -1:].float().log_softmax(-1)]
    for i in range(0, continuation.shape[1], step):
        logits = model(continuation[:, i : i + step], cache=cache, use_cache=True).logits[0]
        rows.append(logits.float().log_softmax(-1))
    return torch.cat(rows)[: continuation.shape[1]], cache


def fisher_information(model, ids: torch.Tensor, draws: int = 2) -> list[float]:
    """Each layer's mean Fisher information per element of its attention output (the input
    of ``o_proj``, where the allocator's distortions live), on ``ids`` (1, T).

    Labels are drawn from the model's own next-token distributions, so the mean of g² is the
    diagonal of the Hessian of the KL to the model, the loss a cache error adds; ``draws``
    draws per token. Hooks on the decoder layers of a Llama-style model.
    """
    outputs = {}

    def keep(i):
        def hook(module, args):
            args[0].retain_grad()
            outputs[i] = args[0]
        return hook

    handles = [layer.self_attn.o_proj.register_forward_pre_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    total = [0.0] * len(handles)
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.enable_grad():
            for _ in range(draws):
                embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
                logits = model(inputs_embeds=embeds, use_cache=False).logits[0].float()
                labels = torch.multinomial(logits.detach().softmax(-1), 1, generator=generator)[:, 0]
                torch.nn.functional.cross_entropy(logits, labels, reduction="sum").backward()
                for i, a in outputs.items():
                    total[i] += float(a.grad.float().square().mean()) / draws
                outputs.clear()
    finally:
        for h in handles:
            h.remove()
    return total


def load_sensitivity(path: str) -> list[float]:
    """Per-layer sensitivities: a JSON list, a layer profile, or ``layer_sensitivity`` of an artifact or its report."""
    if path.endswith("-layers.safetensors"):  # a layer profile (hqekv calibrate --profile)
        from hqekv.profiles import load_profile

        return list(load_profile(path).sensitivity)
    if path.endswith(".safetensors"):
        from hqekv.artifacts import load_artifact

        return list(load_artifact(path).metadata["layer_sensitivity"])
    data = json.loads(open(path).read())
    if isinstance(data, dict):
        data = data.get("metadata", data)["layer_sensitivity"]
    return [float(x) for x in data]


def measure_sensitivity(model, text, segments, bits: float) -> list[float]:
    """Mean KL over ``segments`` of the continuation with one layer at ``auto:bits`` and the
    others at 16 bits, per layer (module docstring)."""
    from hqekv.patches.base import sliding_windows

    n = sliding_windows(model.config.get_text_config()).count(None)
    with torch.no_grad():
        reference = {s: continuation_logprobs(model, text.context[s : s + 1], text.continuation[s : s + 1])[0]
                     for s in segments}  # fmt: skip
    out = []
    for i in range(n):
        layer_bits = [16.0] * n
        layer_bits[i] = bits
        kl = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hqekv.patch_model(model, sum(layer_bits) / n, ratios="auto", layer_bits=layer_bits)
            try:
                with torch.no_grad():
                    for s in segments:
                        logp, _ = continuation_logprobs(model, text.context[s : s + 1], text.continuation[s : s + 1])
                        ref = reference[s]
                        kl.append(float((ref.exp() * (ref - logp)).sum(-1).mean()))
            finally:
                hqekv.unpatch_model(model)
        out.append(sum(kl) / len(kl))
        print(f"layer {i}: KL {out[-1]:.3g}", flush=True)
    return out


def residual_ratio(model, power: float):
    """ρ**power per layer from hooks on the decoder layers (module docstring), read at each share."""
    from hqekv.config import HqeKVConfig

    window = HqeKVConfig.window  # the window queries' count the importance reads
    stream, rho, handles = {}, {}, []

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

    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_pre_hook(before(i), with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(after(i)))

    def norm(i, energy):  # distortions / energy · ρ**power
        return energy / rho[i].to(energy).clamp(min=1e-12) ** power

    return norm, handles


@contextlib.contextmanager
def layer_weight(norm, handles=()):
    """Share the budget with each layer's distortions divided by ``norm(layer_idx, energy)``
    instead of its window output energy (module docstring)."""
    from hqekv import allocation
    from hqekv.cache.model_cache import HqeKVCache

    order = []
    share, share_budget = allocation.share, HqeKVCache.share_budget

    def weighed_share(layers, bytes_k, bytes_v, floor=None):
        if len(layers) == len(order) > 1:  # the model's budget, not one layer's own
            layers = [dataclasses.replace(x, energy=norm(i, x.energy)) for x, i in zip(layers, order)]
        return share(layers, bytes_k, bytes_v, floor)

    def ordered_share_budget(cache):
        order[:] = [x.layer_idx for x in cache.hqekv_layers if x.is_initialized and x.pending is not None]
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
    parser.add_argument("--layer-weight", choices=["energy", "residual", "residual-sqrt", "fisher", "fisher-sqrt"], default="energy",
                        help="how the shared budget weighs each layer (an ablation; module docstring)")
    parser.add_argument("--split", metavar="SENSITIVITY",
                        help="auto:B methods with each layer at its own budget split by these sensitivities")
    parser.add_argument("--strength", type=float, default=hqekv.allocation.LAYER_STRENGTH,
                        help="γ of the split (default %(default)s)")
    parser.add_argument("--measure-sensitivity", metavar="FILE",
                        help="measure per-layer sensitivities with the allocator, write them to FILE and stop")
    parser.add_argument("--bits", type=float, default=1.0, help="the budget of the layer measured (default %(default)s)")
    parser.add_argument("--heldout", type=int, metavar="SEED", help="score on held-out text drawn by SEED")
    parser.add_argument("--heldout-text", choices=["squad", "essays"], default="squad")
    parser.add_argument("--head-eviction", choices=["chunk", "head"], default=hqekv.allocation.HEAD_EVICTION,
                        help="heads:B methods: a chunk evicted for all its KV heads or each head apart (an ablation)")
    args = parser.parse_args()
    hqekv.allocation.HEAD_EVICTION = args.head_eviction
    if args.heldout is not None and args.layer_weight.startswith("fisher"):
        parser.error("--layer-weight fisher measures on the development text's next segment: not with --heldout")
    model, tokenizer, _ = load_model(args.model)
    if args.measure_sensitivity:
        text = calibration_text(tokenizer, args.context, 128, 2 * args.segments)
        sensitivity = measure_sensitivity(model, text, range(args.segments, 2 * args.segments), args.bits)
        with open(args.measure_sensitivity, "w") as f:
            json.dump(sensitivity, f)
        return
    split = None
    if args.split:
        from hqekv.allocation import split_budget

        sensitivity = load_sensitivity(args.split)
        split = lambda bavg: split_budget(bavg, sensitivity, args.strength)  # noqa: E731
    text = calibration_text(tokenizer, args.context, 128, args.segments + 1)  # the last: Fisher's own segment
    if args.heldout is not None:
        text = heldout_text(tokenizer, args.context, args.segments, args.heldout, args.heldout_text)
    reference = []
    with torch.no_grad():
        for s in range(args.segments):
            ids = text.context[s : s + 1]
            reference.append(continuation_logprobs(model, ids, text.continuation[s : s + 1])[0])
    rows = {}
    defaults = hqekv.allocation.ERROR_MODEL, hqekv.allocation.LAYER_SCALE
    weight, fisher = {"energy": None, "residual": 1.0, "residual-sqrt": 0.5}.get(args.layer_weight), None
    if args.layer_weight.startswith("fisher"):
        fisher = fisher_information(model, text.context[args.segments :])
        print("Fisher per layer:", " ".join(f"{f:.3g}" for f in fisher), flush=True)
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
            if weight:
                weighed = layer_weight(*residual_ratio(model, weight))
            elif fisher and args.layer_weight == "fisher":  # distortions · F
                weighed = layer_weight(lambda i, energy: torch.full_like(energy, 1 / fisher[i]))
            elif fisher:  # distortions · √F / √energy
                weighed = layer_weight(lambda i, energy: (energy / fisher[i]).sqrt())
            else:
                weighed = contextlib.nullcontext()
            extra = {"layer_bits": split(method.bits)} if split and method.kind == "auto" else {}
            with weighed, method.applied(model, **extra) as config, torch.no_grad():
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
    where = "calibration articles (development)" if args.heldout is None else f"held-out {args.heldout_text}, seed {args.heldout}"
    save(args.out, {"model": args.model, "text": where, "context": args.context,
                    "segments": args.segments, "layer_weight": args.layer_weight, "fisher": fisher, "split": args.split,
                    "strength": args.strength if args.split else None, "head_eviction": args.head_eviction, "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()

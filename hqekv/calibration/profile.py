""":func:`measure_profile`: a model's layer profile (:mod:`hqekv.profiles`), what lets the
rate-distortion allocator give each layer its own share of any budget."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..config import CACHE_SETTINGS, check_bavg
from .layer_budgets import PROFILE_BITS, allocator_sensitivity
from .objective import CONTINUATION_TOKENS, SegmentedObjective, context_length
from .study import DEFAULT_SEGMENTS, _duration


def measure_profile(
    model,
    tokenizer,
    *,
    bits: float = PROFILE_BITS,
    out: str | Path | None = None,
    context_tokens: int | None = None,
    segments: int = DEFAULT_SEGMENTS,
    continuation_tokens: int = CONTINUATION_TOKENS,
    model_id: str | None = None,
    progress: bool = True,
    **settings,
):
    """Measure the layer profile of ``model``: per compressed layer, the mean KL of the
    calibration continuations with that layer alone under the allocator at ``bits`` and
    every other layer FP16 (:func:`allocator_sensitivity`), on the text :func:`calibrate`
    reads (the same segments and lengths by default).

    ``patch_model(model, bavg)`` then finds the profile written to ``out`` (by default
    nowhere; the CLI writes to ``$HQEKV_CACHE/artifacts``) and, wherever it runs the
    allocator, splits ``bavg`` over the layers by it (:func:`hqekv.allocation.split_budget`).
    Costs two prefills per segment and one continuation forward per layer and segment: a
    few minutes on a CPU for a 0.5B model, far less than one bavg's search.

    Returns the :class:`hqekv.profiles.LayerProfile` (its ``path`` is None unless written).
    """
    from .. import __version__
    from ..artifacts import model_fingerprint
    from ..profiles import LayerProfile, load_profile, save_profile
    from ..texts import calibration_text

    bits = check_bavg(bits)
    if bits >= 16:
        raise ValueError("a layer profile is measured below 16 bits: at 16 bits no layer loses anything")
    context_tokens = context_length(model, context_tokens, continuation_tokens, segments)
    text = calibration_text(tokenizer, context_tokens, continuation_tokens, segments)
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else (lambda line: None)
    say(f"hqekv profile: prefilling {text.context.shape[0]} segments ({text.context.shape[1]} context + "
        f"{text.continuation.shape[1]} continuation tokens)")  # fmt: skip
    start = time.perf_counter()
    objective = SegmentedObjective(model, text.context, text.continuation, **settings)
    n = objective.n_layers
    # one compressed prefill per segment (about what the FP16 one cost) and one forward per layer
    say(f"hqekv profile: prefill {_duration(objective.setup_seconds)}, one forward {objective.trial_seconds:.2f} s: "
        f"{n} layers, about {_duration(objective.setup_seconds + n * objective.trial_seconds)} more")  # fmt: skip
    sensitivity = allocator_sensitivity(objective, bits)
    seconds = time.perf_counter() - start
    say(f"hqekv profile: done in {_duration(seconds)}")
    config = objective.config
    metadata = {
        "model_id": model_id or getattr(model.config, "_name_or_path", "") or model.config.model_type,
        "model_type": model.config.get_text_config().model_type,
        "config_fingerprint": model_fingerprint(model),
        **{name: getattr(config, name) for name in CACHE_SETTINGS},
        "bits": bits,
        **text.metadata(),
        "library_version": __version__,
        "seconds": round(seconds, 3),
    }
    if out is None:
        return LayerProfile(None, tuple(sensitivity), {**metadata, "layer_sensitivity": sensitivity})
    return load_profile(save_profile(Path(out), sensitivity, metadata))

"""The study: Optuna TPE over (δ3, δ4) (paper Algorithm 1), its result, its cost, and
:func:`calibrate` and :func:`split_artifact`, which end in artifacts."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..config import CACHE_SETTINGS, TierRatios, check_bavg
from .layer_budgets import LAYER_STRENGTHS, layer_budgets
from .objective import (
    ALPHA,
    BETA,
    CONTINUATION_TOKENS,
    CompressionObjective,
    SegmentedObjective,
    context_length,
    data_term,
    segment_kls,
)
from .search_space import ratios_from_free, search_box, shift_box, split_ratios_from_free


DEFAULT_TRIALS = 200




DEFAULT_SEGMENTS = 4


SEARCH_ROTATION = None
"""The basis :func:`calibrate` searches in unless told: unrotated (``docs/calibration.md`` §4)."""


@dataclass
class CalibrationResult:
    """Best ratios of one study, its history and what the artifact records."""

    bavg: float
    ratios: TierRatios
    best_loss: float
    best_kl: float
    trials: int
    history: list[dict] = field(default_factory=list)  # number, params, loss, kl, kls (per segment), state, seconds
    metadata: dict = field(default_factory=dict)
    path: Path | None = None
    key_ratios: TierRatios | None = None  # the keys' own shares (asymmetric search); ``ratios`` are the values'
    layer_ratios: tuple[TierRatios, ...] | None = None  # per-layer budgets split from ``ratios`` (per_layer)

    def report(self) -> dict:
        return {
            "bavg": self.bavg,
            "ratios": dict(zip(TierRatios.names(), self.ratios.as_tuple())),
            "key_ratios": None if self.key_ratios is None else dict(zip(TierRatios.names(), self.key_ratios.as_tuple())),
            "layer_ratios": None if self.layer_ratios is None
            else [dict(zip(TierRatios.names(), r.as_tuple())) for r in self.layer_ratios],
            "best_loss": self.best_loss,
            "best_kl": self.best_kl,
            "trials": self.trials,
            "metadata": self.metadata,
            "history": self.history,
        }


def study_name(
    fingerprint: str, bavg: float, settings: dict, seed: int, kl_scale: str = "log", asymmetric: bool = False
) -> str:
    """Deterministic, so that re-running the same calibration continues the same study."""
    parts = [f"{k}={settings[k]}" for k in CACHE_SETTINGS if k in settings and settings[k] is not None]
    if kl_scale != "log":
        parts.append(f"kl_scale={kl_scale}")
    if asymmetric:
        parts.append("asymmetric")
    return f"hqekv-{fingerprint[:16]}-bavg{bavg:g}-seed{seed}" + ("-" + ",".join(parts) if parts else "")


def run_study(
    objective: CompressionObjective,
    bavg: float,
    *,
    trials: int = DEFAULT_TRIALS,
    storage: str | None = None,
    name: str = "hqekv",
    seed: int = 0,
    alpha: float = ALPHA,
    beta: float = BETA,
    kl_scale: str = "log",
    progress: bool = True,
    worker: int = 0,
    asymmetric: bool = False,
) -> CalibrationResult:
    """Run (or continue) one TPE study until it holds ``trials`` completed trials.

    ``objective``: a :class:`CompressionObjective` (``kl``) or :class:`SegmentedObjective`
    (``kls``, one KL per segment); a trial's loss is the mean data term over the segments
    plus α·δ3 + β·δ4 (δ3 the mean of the key and value 1-bit shares).

    ``asymmetric``: search keys and values apart: four variables, the key/value budget
    split ``shift`` (keys bavg + shift, values bavg − shift), the shared evicted share and
    each component's 1-bit share as a fraction of its feasible range
    (:func:`split_ratios_from_free`). False (default): the paper's two
    (δ3, δ4), one set of ratios for both. Infeasible samples (δ1 < 0 or δ2 < 0) are pruned without running the model. Several
    processes may run this on one RDB ``storage``; each stops once the study is complete.
    The sampler is seeded with ``seed + worker`` so that workers propose different trials.
    """
    import optuna
    from optuna.trial import TrialState
    from tqdm.auto import tqdm

    bavg = check_bavg(bavg)
    hi3, hi4 = search_box(bavg)
    data_term(1.0, kl_scale)  # validates the name before any work
    if not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be a positive integer, got {trials!r}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=name,
        storage=storage,
        load_if_exists=True,
        direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=seed + worker),
    )
    for key, value in (("bavg", bavg), ("alpha", alpha), ("beta", beta), ("kl_scale", kl_scale), ("asymmetric", asymmetric)):
        stored = study.user_attrs.get(key)
        if stored is not None and stored != value:
            raise ValueError(f"study {name!r} in {storage} was run with {key}={stored!r}, not {value!r}")
        study.set_user_attr(key, value)

    def completed() -> int:
        return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))

    def evaluate(trial) -> float:
        if asymmetric:
            shift = trial.suggest_float("shift", -shift_box(bavg), shift_box(bavg))
            u3k = trial.suggest_float("u3k", 0.0, 1.0)
            u3v = trial.suggest_float("u3v", 0.0, 1.0)
            x4 = trial.suggest_float("x4", 0.0, hi4)
            pair = split_ratios_from_free(bavg, shift, u3k, u3v, x4)
            if pair is None:
                raise optuna.TrialPruned("infeasible: no 1-bit share makes δ1, δ2 ≥ 0 for keys or values")
            key_ratios, ratios = pair
            x3 = (key_ratios.int1 + ratios.int1) / 2
            trial.set_user_attr("x3k", key_ratios.int1)
            trial.set_user_attr("x3v", ratios.int1)
        else:
            x3 = trial.suggest_float("x3", 0.0, hi3)
            x4 = trial.suggest_float("x4", 0.0, hi4)
            ratios, key_ratios = ratios_from_free(bavg, x3, x4), None
            if ratios is None:
                raise optuna.TrialPruned("infeasible: δ1 < 0 or δ2 < 0")
        start = time.perf_counter()
        kls = segment_kls(objective, ratios, key_ratios)
        trial.set_user_attr("kl", statistics.fmean(kls))
        if len(kls) > 1:
            trial.set_user_attr("kls", kls)
        trial.set_user_attr("seconds", time.perf_counter() - start)
        return statistics.fmean(data_term(kl, kl_scale) for kl in kls) + alpha * x3 + beta * x4

    done = completed()
    bar = tqdm(total=trials, initial=min(done, trials), desc=f"calibrate bavg={bavg:g}", disable=not progress)
    attempts = 0
    while done < trials:
        # Infeasible samples are free; the cap only stops a pathological sampler.
        if attempts > 50 * trials:
            raise RuntimeError(f"study {name!r}: {attempts} samples gave only {done} feasible trials")
        study.optimize(evaluate, n_trials=1, catch=())
        attempts += 1
        now = completed()
        bar.update(min(now, trials) - min(done, trials))
        done = now
    bar.close()
    return _result(study, bavg)


def study_result(storage: str, name: str, bavg: float) -> CalibrationResult:
    """The result of a study as it stands in ``storage`` (e.g. once every worker is done)."""
    import optuna

    return _result(optuna.load_study(study_name=name, storage=storage), bavg)


def _result(study, bavg: float) -> CalibrationResult:
    from optuna.trial import TrialState

    history = []
    for t in study.get_trials(deepcopy=False):
        history.append(
            {
                "number": t.number,
                "state": t.state.name,
                **{name: t.params.get(name) for name in ("x3", "x4", "shift", "u3k", "u3v") if name in t.params},
                **{name: t.user_attrs[name] for name in ("x3k", "x3v") if name in t.user_attrs},
                "loss": t.value,
                "kl": t.user_attrs.get("kl"),
                "kls": t.user_attrs.get("kls"),
                "seconds": t.user_attrs.get("seconds"),
            }
        )
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    if not complete:
        raise RuntimeError(f"study {study.study_name!r} has no completed trial")
    best = min(complete, key=lambda t: t.value)
    p = best.params
    if "shift" in p:
        key_ratios, ratios = split_ratios_from_free(bavg, p["shift"], p["u3k"], p["u3v"], p["x4"])
    else:
        key_ratios, ratios = None, ratios_from_free(bavg, p["x3"], p["x4"])
    return CalibrationResult(
        bavg=bavg,
        ratios=ratios,
        key_ratios=key_ratios,
        best_loss=float(best.value),
        best_kl=float(best.user_attrs["kl"]),
        trials=len(complete),
        history=history,
    )


def calibration_cost(
    bavgs: Sequence[float], trials: int, per_layer: bool, n_layers: int, setup_seconds: float, trial_seconds: float
) -> tuple[int, float]:
    """Trials :func:`calibrate` scores for ``bavgs`` and the seconds they should take, from
    the measured seconds of one trial: ``trials`` per bavg, and with ``per_layer`` one per
    layer and one per strength of :data:`LAYER_STRENGTHS` more. -> (trials, seconds), the
    setup (already run) included."""
    n = len(bavgs) * (trials + (n_layers + len(LAYER_STRENGTHS) if per_layer else 0))
    return n, setup_seconds + n * trial_seconds


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def calibrate(
    model,
    tokenizer,
    bavg: float | Sequence[float] = 3.2,
    *,
    trials: int = DEFAULT_TRIALS,
    storage: str | None = None,
    out: str | Path | None = None,
    seed: int = 0,
    context_tokens: int | None = None,
    segments: int = DEFAULT_SEGMENTS,
    continuation_tokens: int = CONTINUATION_TOKENS,
    alpha: float = ALPHA,
    beta: float = BETA,
    kl_scale: str = "log",
    asymmetric: bool = False,
    per_layer: bool = False,
    model_id: str | None = None,
    progress: bool = True,
    barrier=None,
    worker: int = 0,
    **settings,
) -> CalibrationResult | list[CalibrationResult]:
    """Find the tier ratios of ``model`` at each ``bavg`` by TPE (SPEC §1.5).

    Parameters
    ----------
    model, tokenizer : an unpatched Hugging Face causal LM of a supported architecture
    bavg : float or sequence of floats in (0, 4)
        One study per value; the calibration prefill is shared.
    trials : int, default 200
        Completed (feasible) trials per study; a re-run continues the study up to this count.
    storage : Optuna storage URL, optional
        None keeps the studies in memory; ``sqlite:///study.db`` makes them resumable; any
        RDB URL lets several workers share them.
    out : directory, optional
        Where to write one artifact per bavg (see :mod:`hqekv.artifacts`) and its report.
    seed : int
        Seed of the TPE sampler.
    segments, context_tokens, continuation_tokens : int
        The calibration text is cut into ``segments`` consecutive (context, continuation)
        pairs; each context is prefilled once and its continuation scored. The context
        defaults to ``CALIBRATION_TOKENS / segments - continuation_tokens`` (4 × (3968 + 128):
        the paper's 16K tokens of text), capped so that context and continuation fit the
        model's ``max_position_embeddings``: past its trained context a model's
        distributions are off-distribution noise, and so is their KL (:func:`context_length`).
    alpha, beta : float
        Penalties on δ3 and δ4 in the objective.
    kl_scale : {"log", "linear"}, default "log"
        Data term: ln of the mean KL, on which α, β are tie-breakers (:func:`data_term`), or
        the mean KL itself (the paper's scale, under which the regulariser decides alone).
    asymmetric : bool, default False
        Search separate key and value ratios under the one budget (:func:`run_study`).
        False searches one set for both, as the paper does; on SmolLM2 the separate search
        did not win at equal bytes (``docs/results.md``, ablation).
    per_layer : bool, default False
        After the search, split its budget over the layers by their measured sensitivity
        (:func:`layer_budgets`: one trial's cost per layer plus one per strength tried) and
        record the per-layer ratios in the artifact when the split lowers the loss. Not
        with ``asymmetric``.
    model_id : str, optional
        Recorded in the artifact; defaults to the model's ``name_or_path``.
    barrier : callable, optional
        With several workers on one ``storage``: called when this worker's study is done
        (e.g. ``accelerate.PartialState().wait_for_everyone``); the result is then read
        back from the storage, so that it covers every worker's trials. Give ``out`` to one
        worker only, and each its own ``worker`` index (it offsets the sampler seed).
    **settings : HqeKVConfig fields other than the ratios (chunk_size, window, ...)
        ``rotation`` defaults to None here: the search runs in the unrotated basis, whose
        ratios measured better per byte in the rotated cache too (``docs/calibration.md``).

    Returns one :class:`CalibrationResult` per bavg (a list if ``bavg`` is a sequence).
    """
    from .. import __version__
    from ..artifacts import model_fingerprint, save_artifact, write_report
    from ..texts import calibration_text

    if barrier is not None and storage is None:
        raise ValueError("workers that share a study need a shared storage URL")
    if per_layer and asymmetric:
        raise ValueError("per_layer and asymmetric cannot be combined: per-layer budgets hold for keys and values alike")
    data_term(1.0, kl_scale)
    single = not isinstance(bavg, (list, tuple))
    values = [check_bavg(b) for b in ([bavg] if single else bavg)]
    for b in values:
        search_box(b)
    context_tokens = context_length(model, context_tokens, continuation_tokens, segments)
    text = calibration_text(tokenizer, context_tokens, continuation_tokens, segments)
    settings.setdefault("rotation", SEARCH_ROTATION)
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else (lambda line: None)
    device = next(model.parameters()).device
    say(f"hqekv calibrate: {len(values)} bavg × {trials} trials on {device}; first each of {text.context.shape[0]} "
        f"segments ({text.context.shape[1]} context + {text.continuation.shape[1]} continuation tokens) is prefilled "
        "once and one trial timed")  # fmt: skip
    objective = SegmentedObjective(model, text.context, text.continuation, **settings)
    n_trials, seconds = calibration_cost(
        values, trials, per_layer, objective.n_layers, objective.setup_seconds, objective.trial_seconds
    )
    say(f"hqekv calibrate: prefill {_duration(objective.setup_seconds)}, one trial {objective.trial_seconds:.2f} s: "
        f"{n_trials} trials, about {_duration(seconds)} in all (a study resumed from its storage runs only its "
        "missing trials)")  # fmt: skip
    fingerprint = model_fingerprint(model)
    config = objective.config
    results = []
    for b in values:
        name = study_name(fingerprint, b, objective.settings, seed, kl_scale, asymmetric)
        start = time.perf_counter()
        result = run_study(
            objective, b, trials=trials, storage=storage, name=name, seed=seed, alpha=alpha, beta=beta,
            kl_scale=kl_scale, progress=progress, worker=worker, asymmetric=asymmetric,
        )
        if barrier is not None:
            barrier()
            result = study_result(storage, name, b)
        result.metadata = {
            "model_id": model_id or getattr(model.config, "_name_or_path", "") or model.config.model_type,
            "model_type": model.config.get_text_config().model_type,
            "config_fingerprint": fingerprint,
            "bavg": b,
            **{name: getattr(config, name) for name in CACHE_SETTINGS},
            "asymmetric": asymmetric,
            "per_layer": per_layer,
            "alpha": alpha,
            "beta": beta,
            "kl_scale": kl_scale,
            "trials": result.trials,
            "best_loss": result.best_loss,
            "best_kl": result.best_kl,
            "seed": seed,
            "study_name": name,
            **text.metadata(),
            "library_version": __version__,
            "setup_seconds": round(objective.setup_seconds, 3),
            "study_seconds": round(time.perf_counter() - start, 3),
        }
        if per_layer:
            budgets = layer_budgets(objective, result.ratios, alpha=alpha, beta=beta, kl_scale=kl_scale)
            result.layer_ratios = budgets.layer_ratios
            result.metadata.update(budgets.metadata())
            chosen = min(budgets.search, key=lambda row: row["loss"])
            result.best_loss, result.best_kl = chosen["loss"], chosen["kl"]
            result.metadata.update(best_loss=result.best_loss, best_kl=result.best_kl)
        if out is not None:
            result.path = save_artifact(Path(out), result.ratios, result.metadata, key_ratios=result.key_ratios,
                                        layer_ratios=result.layer_ratios)  # fmt: skip
            write_report(result)
        results.append(result)
    return results[0] if single else results


def split_artifact(model, tokenizer, artifact, *, out: str | Path | None = None, strengths: Sequence[float] = LAYER_STRENGTHS,
                   progress: bool = True) -> CalibrationResult:  # fmt: skip
    """Per-layer budgets (:func:`layer_budgets`) for the ratios of an existing artifact,
    without re-running its search: what ``calibrate(..., per_layer=True)`` adds after the
    search, on the same calibration text, settings, α, β and data term as the artifact's.

    ``artifact``: a path or :class:`~hqekv.artifacts.Artifact` of one set of ratios for
    ``model`` (fingerprint checked). Writes the new artifact to ``out`` (a directory or
    ``.safetensors`` path) when given: the artifact's metadata plus the per-layer fields
    (``per_layer``, ``layer_strength``, ``layer_sensitivity``, ``layer_search``,
    ``layer_seconds``, ``split_from``). Takes one trial's time per layer plus one per strength.
    """
    from .. import __version__
    import json

    from ..artifacts import (
        Artifact, ArtifactError, check_fits, check_splittable, load_artifact, report_path, save_artifact, write_report,
    )  # fmt: skip
    from ..texts import calibration_text

    base = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
    meta = dict(base.metadata)
    check_splittable(base)
    check_fits(base, model)
    segments = meta.get("segments", 1)
    context_tokens, continuation_tokens = meta.get("context_tokens"), meta.get("continuation_tokens")
    if not (isinstance(context_tokens, int) and isinstance(continuation_tokens, int) and isinstance(segments, int)):
        raise ArtifactError(f"{base.path} does not record its calibration text's segments and lengths")
    text = calibration_text(tokenizer, context_tokens, continuation_tokens, segments)
    if text.sha256 != meta["calibration_data_sha256"]:
        raise ArtifactError(f"{base.path} was calibrated on other text (sha256 {meta['calibration_data_sha256'][:12]}) than "
                            f"this tokenizer gives ({text.sha256[:12]})")  # fmt: skip
    settings = {name: meta[name] for name in CACHE_SETTINGS if name in meta}
    objective = SegmentedObjective(model, text.context, text.continuation, **settings)
    kl_scale = meta.get("kl_scale", "log")
    budgets = layer_budgets(objective, base.ratios, strengths=strengths, alpha=meta["alpha"], beta=meta["beta"],
                            kl_scale=kl_scale)  # fmt: skip
    chosen = min(budgets.search, key=lambda row: row["loss"])
    meta.update(budgets.metadata(), per_layer=True, best_loss=chosen["loss"], best_kl=chosen["kl"],
                split_from=base.path.name, library_version=__version__)  # fmt: skip
    meta.pop("format", None), meta.pop("format_version", None), meta.pop("ratios", None)
    report = report_path(base.path)
    history = json.loads(report.read_text()).get("history", []) if report.is_file() else []  # the search's trials
    result = CalibrationResult(bavg=base.bavg, ratios=base.ratios, best_loss=chosen["loss"], best_kl=chosen["kl"],
                               trials=meta["trials"], history=history, metadata=meta, layer_ratios=budgets.layer_ratios)  # fmt: skip
    if out is not None:
        result.path = save_artifact(Path(out), result.ratios, meta, layer_ratios=result.layer_ratios)
        write_report(result)
    return result

"""How a patched model plugs into transformers: the wrappers that replace a model's
``generate``, its decoder's ``forward`` and ``generate``'s private helpers
(``_prepare_cache_for_generation``, ``prepare_inputs_for_generation``,
``create_masks_for_generate``, ``_prefill``), and the record of what they replaced.

This module depends on transformers internals that are not public API: the names and
positional arguments of those helpers (``max_cache_length`` as the third positional
argument of ``_prepare_cache_for_generation``), ``_valid_auto_compile_criteria``,
``generation_config.prefill_chunk_size`` and ``disable_compile``, and the cache argument's
name (``cache``, ``past_key_values`` before transformers 5.2x). tests/test_transformers_internals.py
holds each of them to the transformers version installed.
"""

from __future__ import annotations

import copy
import inspect
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .cache import HqeKVCache
from .config import HqeKVConfig
from .memory import OVER_BUDGET_WARNING, MemoryReport
from .patches import PADDING_MASK, PatchedAttention, sliding_windows

RECORD = "_hqekv_patch"
"""The attribute of a patched model that holds its :class:`PatchRecord`."""


class _RequestState(threading.local):
    """Per thread: the cache of the generate call running, the last cache used and its report."""

    current: HqeKVCache | None = None  # strong ref only while a generate call runs
    last_cache: Any = None  # weakref to the last cache used
    last_report: MemoryReport | None = None


def _per_thread(name: str) -> property:
    return property(lambda self: getattr(self._requests, name), lambda self, v: setattr(self._requests, name, v))


@dataclass
class PatchRecord:
    """What patching replaced, to restore it exactly, plus per-thread handles for reporting.

    The request state is thread-local: two threads generating on one patched model each see
    their own last cache in :func:`memory_report`.
    """

    config: HqeKVConfig
    saved: list[tuple[Any, str, bool, Any]] = field(default_factory=list)  # (obj, attr, had_own, previous)
    warned_cache_implementation: bool = False
    warned_over_budget: bool = False
    _requests: _RequestState = field(default_factory=_RequestState, repr=False, compare=False)

    current = _per_thread("current")
    last_cache = _per_thread("last_cache")
    last_report = _per_thread("last_report")

    def __getstate__(self) -> dict:
        """Copies and pickles keep what patching replaced, not any request's cache."""
        return {k: v for k, v in self.__dict__.items() if k != "_requests"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._requests = _RequestState()

    def replace(self, obj, attr: str, value) -> None:
        had_own = attr in obj.__dict__
        self.saved.append((obj, attr, had_own, obj.__dict__.get(attr)))
        setattr(obj, attr, value)

    def restore(self) -> None:
        for obj, attr, had_own, previous in reversed(self.saved):
            if had_own:
                setattr(obj, attr, previous)
            else:
                obj.__dict__.pop(attr, None)
        self.saved.clear()


def _decoder(model) -> torch.nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        raise TypeError(f"cannot find the decoder of {type(model).__name__}")
    return decoder


def _input_valid(attention_mask, n_new: int) -> torch.Tensor | None:
    """Padding mask (B, S) bool of the new tokens from a 2-D ``attention_mask``, or None."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise NotImplementedError(
            "hqekv takes a 2-D attention_mask (batch, length) marking padding with 0; "
            f"got a {attention_mask.dim()}-D mask"
        )
    if attention_mask.shape[1] < n_new:
        raise ValueError(f"attention_mask covers {attention_mask.shape[1]} tokens but the input has {n_new}")
    return attention_mask[:, -n_new:].bool()


def new_cache(model, max_length: int | None = None) -> HqeKVCache:
    """A fresh HqeKV cache for a patched model; static, with room for ``max_length`` tokens
    per row, when that is given (see :class:`HqeKVCache`)."""
    record = getattr(model, RECORD, None)
    if record is None:
        raise ValueError("this model is not patched; call hqekv.patch_model(model) first")
    return cache_for(record.config, model, max_length)


def cache_for(config: HqeKVConfig, model, max_length: int | None = None) -> HqeKVCache:
    """An empty cache for ``model`` under ``config``: HqeKV layers for its global attention
    layers, exact sliding windows for its sliding-window ones."""
    text_config = model.config.get_text_config()
    return HqeKVCache(config, text_config.num_hidden_layers, sliding_windows(text_config), max_length)


def install(model, record: "PatchRecord", attention_classes: tuple, model_type: str) -> None:
    """Replace the forwards of ``model``'s attention modules (``attention_classes``), its
    decoder's forward and ``generate``'s helpers, each through ``record`` (which restores
    them); on an error, everything replaced so far is restored."""
    decoder = _decoder(model)
    try:
        n_patched = 0
        for module in model.modules():
            if isinstance(module, attention_classes):
                record.replace(module, "forward", PatchedAttention(module, model_type))
                n_patched += 1
        if n_patched == 0:
            raise ValueError(f"found no attention modules of {attention_classes} in {type(model).__name__}")
        record.replace(decoder, "forward", _DecoderForward(model, decoder))
        record.replace(model, "_prepare_cache_for_generation", _PrepareCache(model))
        record.replace(model, "prepare_inputs_for_generation", _PrepareInputs(model))
        record.replace(model, "generate", _Generate(model))
        record.replace(model, "create_masks_for_generate", _padding_mask_for_generate)
        if hasattr(type(model), "_prefill"):
            record.replace(model, "_prefill", _EagerPrefill(model))
    except BaseException:
        record.restore()
        raise


CACHE_ARGUMENTS = ("cache", "past_key_values")


def cache_argument(forward) -> str:
    """The name under which ``forward`` takes its cache: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def output_cache(output):
    """The cache a model output carries: ``output.cache``, or ``output.past_key_values`` before transformers 5.2x."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


# The wrappers below are objects, not closures, so that a patched model survives
# ``copy.deepcopy`` (each wrapper's model or module is copied with the model, so the copy
# runs its own weights) and pickles like the unpatched model. Each calls what it replaced:
# the object's own attribute if it had one (e.g. an accelerate hook), else its class's.


class _DecoderForward:
    """The decoder's ``forward``: an eager step for the cache before each call, then the original."""

    def __init__(self, model, decoder):
        self.model, self.decoder = model, decoder
        self.original = decoder.__dict__.get("forward")  # an instance-level forward (hooks), else None
        forward = self.original or type(decoder).forward
        self.positional = [
            name
            for name, p in inspect.signature(forward).parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and name != "self"
        ]
        self.cache_name = cache_argument(forward)

    def __call__(self, *args, **kwargs):
        prepared = _compiled_decode_arguments(self, args, kwargs) if torch.compiler.is_compiling() else None
        arguments, cache, n_new = prepared or _prepare_forward(self, args, kwargs)
        if self.original is not None:
            out = self.original(**arguments)
        else:
            out = type(self.decoder).forward(self.decoder, **arguments)
        if cache is not None:
            cache.advance(n_new)
            if not torch.compiler.is_compiling():
                cache.share_budget()  # the budget between layers, after a multi-token input
        return out

    def arguments(self, args, kwargs) -> tuple[dict, HqeKVCache | None]:
        """The call's arguments by name, the cache taken out of them."""
        if len(args) > len(self.positional):
            raise TypeError(
                f"{type(self.model).__name__} decoder takes at most {len(self.positional)} positional arguments"
            )
        arguments = {**dict(zip(self.positional, args)), **kwargs}
        # The cache comes as `cache` or `past_key_values` (the name before transformers 5.2x);
        # it goes on under the name this transformers version's decoder takes.
        named = [arguments.pop(name, None) for name in CACHE_ARGUMENTS]
        return arguments, next((c for c in named if c is not None), None)


def _compiled_decode_arguments(wrapper: _DecoderForward, args, kwargs) -> tuple[dict, HqeKVCache, int] | None:
    """Inside a compiled graph, the inputs of a forward over a cache that holds tokens; else None.

    Traceable: no host sync and no Python int that changes from token to token. The eager
    maintenance step (:meth:`HqeKVCache.maintain`) is not part of it: ``generate`` runs it
    between steps, and a loop that calls a compiled model itself calls ``cache.maintain()``
    before each step.
    """
    arguments, cache = wrapper.arguments(args, kwargs)
    if not isinstance(cache, HqeKVCache) or not cache.holds_tokens:
        return None  # a prefill, or no hqekv cache: the eager step (a graph break)
    arguments[wrapper.cache_name] = cache
    n_new, batch, device = _check_inputs(wrapper.model, arguments)
    arguments[PADDING_MASK] = _input_valid(arguments.get("attention_mask"), n_new)
    _decode_inputs(arguments, cache, n_new, batch, device)
    return arguments, cache, n_new


def _inputs(arguments: dict) -> torch.Tensor | None:
    """The input ids, else the input embeddings, else None."""
    inputs = arguments.get("input_ids")
    return arguments.get("inputs_embeds") if inputs is None else inputs


def _check_inputs(model, arguments: dict) -> tuple[int, int, torch.device]:
    """-> new tokens, rows and device of the input; errors for what a patched model cannot do."""
    if arguments.get("output_attentions", getattr(model.config, "output_attentions", False)):
        raise ValueError(
            "output_attentions=True: a patched model attends over a compressed cache and returns no attention "
            "weights; use use_cache=False (exact attention, weights returned) or hqekv.unpatch_model(model)"
        )
    inputs = _inputs(arguments)
    if inputs is None:
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs.shape[1] == 0:
        raise ValueError("empty input: the prompt has no tokens")
    return inputs.shape[1], inputs.shape[0], inputs.device


def _decode_inputs(arguments: dict, cache: HqeKVCache, n_new: int, batch: int, device: torch.device) -> None:
    """Inputs of a forward over a cache that holds tokens, with fixed shapes.

    Attention goes through ``hqekv::mixed_attention``, which masks padding with the mask the
    decoder hands each attention layer (:data:`~hqekv.patches.base.PADDING_MASK`). Positions come from the cache's length tensor and the model's own
    mask is a fixed-shape placeholder, so no length reaches a compiled graph as a Python int.
    """
    if arguments.get("position_ids") is None:
        positions = cache.length_tensor() + torch.arange(n_new, device=device)
        arguments["position_ids"] = positions.to(device)[None].expand(batch, n_new)
    arguments["attention_mask"] = torch.ones(batch, 1, n_new, 1, dtype=torch.bool, device=device)


@torch.compiler.disable(
    reason="hqekv: a prefill (a forward over an empty cache) runs eagerly; compile with fullgraph=True only the "
    "decode steps, after an eager prefill (generate's compile does so)"
)
def _prepare_forward(wrapper: _DecoderForward, args, kwargs) -> tuple[dict, HqeKVCache | None, int]:
    """Eager step before each forward: cache, padding mask, maintenance, fixed-shape inputs."""
    model = wrapper.model
    arguments, cache = wrapper.arguments(args, kwargs)
    use_cache = arguments.get("use_cache")
    if use_cache is None:
        use_cache = model.config.get_text_config().use_cache
    if cache is None and use_cache:
        cache = new_cache(model)
    arguments[wrapper.cache_name] = cache
    if not isinstance(cache, HqeKVCache):
        return arguments, None, 0
    inputs = _inputs(arguments)
    if inputs is not None and inputs.shape[1] == 0 and cache.holds_tokens:
        raise ValueError(
            f"no new tokens for a cache that holds {cache.get_seq_length()}: generate continues a cache only with a "
            "prompt that starts with the tokens it holds (it feeds what follows them), so a prompt no longer than "
            "the cache leaves nothing; for another prompt pass a new cache (hqekv.new_cache(model)) or none"
        )
    n_new, batch, device = _check_inputs(model, arguments)
    arguments[PADDING_MASK] = _input_valid(arguments.get("attention_mask"), n_new)
    record = getattr(model, RECORD, None)
    if record is not None:
        record.last_cache = weakref.ref(cache)
    if cache.holds_tokens:
        if n_new == 1:
            cache.settle()  # a decode step: a prompt that came in pieces is whole (a no-op otherwise)
        cache.maintain()
        _decode_inputs(arguments, cache, n_new, batch, device)
    return arguments, cache, n_new


class _PrepareCache:
    """``_prepare_cache_for_generation``: a new HqeKV cache per request unless one is passed;
    a static one, sized for ``generate``'s maximum length, when ``generate`` will compile
    the decode step (CUDA graphs want fixed addresses)."""

    def __init__(self, model):
        self.model = model
        self.cache_name = cache_argument(type(model).forward)

    def __call__(self, generation_config, model_kwargs, *args, **kwargs):
        user_cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if user_cache is None and generation_config.use_cache is not False:
            cache = new_cache(self.model)
            model_kwargs[self.cache_name] = cache
            max_length = kwargs.get("max_cache_length", args[2] if len(args) > 2 else None)
            if max_length is not None and self.model._valid_auto_compile_criteria(model_kwargs, generation_config):
                # max_cache_length: the tokens the cache will hold (the last one is never stored)
                cache = new_cache(self.model, max_length)
                model_kwargs[self.cache_name] = cache
            getattr(self.model, RECORD).current = cache
            return
        original = type(self.model)._prepare_cache_for_generation
        return original(self.model, generation_config, model_kwargs, *args, **kwargs)


def _passed_cache(kwargs: dict):
    """The cache in keyword arguments, under either name (:data:`CACHE_ARGUMENTS`), or None."""
    return next((kwargs[name] for name in CACHE_ARGUMENTS if kwargs.get(name) is not None), None)


class _PrepareInputs:
    """``prepare_inputs_for_generation``: the original, then, over a cache that holds tokens,
    the cache's eager step (:meth:`HqeKVCache.maintain`) outside the forward that
    ``generate`` may compile, and the padding mask of the new tokens only."""

    def __init__(self, model):
        self.model = model
        self.original = model.__dict__.get("prepare_inputs_for_generation")

    def __call__(self, *args, **kwargs):
        prepare = self.original or type(self.model).prepare_inputs_for_generation.__get__(self.model)
        inputs = prepare(*args, **kwargs)
        cache = _passed_cache(inputs)
        if isinstance(cache, HqeKVCache) and cache.holds_tokens:
            cache.maintain()
            mask, ids = inputs.get("attention_mask"), inputs.get("input_ids")
            if ids is None:
                ids = inputs.get("inputs_embeds")
            if mask is not None and ids is not None and mask.dim() == 2 and mask.shape[1] > ids.shape[1]:
                # over a cache that holds tokens the decoder reads only the new tokens' columns:
                # a fixed-shape input, so a compiled step is not recompiled as the mask grows
                inputs["attention_mask"] = mask[:, -ids.shape[1] :].contiguous()
        return inputs


class _EagerPrefill:
    """``_prefill``: with ``prefill_chunk_size``, the prompt's chunks run eagerly and the
    cache evicts only once the whole prompt is in.

    ``generate`` runs every prompt chunk through the compiled forward when it has a compile
    config; storing a multi-token input in an HqeKV cache (flush, re-rank, budget sharing) is
    an eager step, which breaks a ``fullgraph=True`` graph and recompiles at every chunk
    otherwise. The chunks run eagerly, like a one-shot prefill; the decode steps that follow
    still run the compiled call. Around the chunks, :meth:`HqeKVCache.defer_eviction` and
    :meth:`HqeKVCache.settle`: the question at the end of a prompt decides what is evicted.
    """

    def __init__(self, model):
        self.model = model
        self.original = model.__dict__.get("_prefill")

    def __call__(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
        prefill = self.original or type(self.model)._prefill.__get__(self.model)
        if generation_config.prefill_chunk_size is None:
            return prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
        if not generation_config.disable_compile:
            generation_config = copy.copy(generation_config)
            generation_config.disable_compile = True  # read by _valid_auto_compile_criteria
        cache = _passed_cache(model_kwargs)
        if not isinstance(cache, HqeKVCache):
            return prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
        cache.defer_eviction()
        out = prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
        cache.settle()
        return out


def _check_cache_implementation(model, record: PatchRecord, kwargs: dict) -> None:
    """A patched model keeps its cache with hqekv: a ``cache_implementation`` asked for in this
    call is an error; one in the model's own generation config (e.g. Gemma's ``"hybrid"``)
    is not used, which a warning says once."""
    asked = kwargs.get("cache_implementation")
    config = kwargs.get("generation_config")
    if asked is None and config is not None:
        asked = getattr(config, "cache_implementation", None)
    if asked is not None:
        raise ValueError(
            f"cache_implementation={asked!r}: this model is patched by hqekv and keeps its KV cache as an "
            "HqeKVCache; drop the argument, or call hqekv.unpatch_model(model) first"
        )
    default = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    if default is not None and not record.warned_cache_implementation:
        record.warned_cache_implementation = True
        warnings.warn(
            f"hqekv: the model's generation config asks for cache_implementation={default!r}; the patched model "
            "uses an HqeKVCache instead (sliding layers keep their exact window)",
            UserWarning,
            stacklevel=3,
        )


def _warn_over_budget(record: PatchRecord, report: MemoryReport) -> None:
    """Warn once per patched model when fixed costs push the stored bits far past the request."""
    if report.over_budget > OVER_BUDGET_WARNING and not record.warned_over_budget:
        record.warned_over_budget = True
        cfg = record.config
        fixed = f"the FP16 tail of up to {cfg.chunk_size} tokens"
        if cfg.allocation == "ratios":  # the allocator counts protected chunks in its budget
            fixed = f"the {cfg.protected_chunks} protected FP16 chunks per layer and {fixed}"
        warnings.warn(
            f"hqekv: this request stored {report.compressed_bavg:.2f} code bits per element against the requested "
            f"bavg {report.requested_bavg:g}: at {report.chunks.get('real_tokens', 0)} tokens {fixed} "
            "dominate. Compression pays off on longer inputs (see hqekv.memory_report)",
            UserWarning,
            stacklevel=3,
        )


def _padding_mask_for_generate(*, attention_mask=None, **_):
    """``create_masks_for_generate`` of a patched model: the 2-D padding mask, kept as it is.

    ``generate`` builds a 4-D mask before each step when the cache is compileable; hqekv
    masks inside its own attention and needs only which tokens are padding.
    """
    return attention_mask


class _Generate:
    """``generate``: the cache passed under either name reaches the model under its own; the
    request's memory report is kept for :func:`memory_report`."""

    def __init__(self, model):
        self.model = model
        self.original = model.__dict__.get("generate")
        self.cache_name = cache_argument(type(model).forward)
        self.__doc__ = (self.original or type(model).generate).__doc__

    def __call__(self, *args, **kwargs):
        record = getattr(self.model, RECORD)
        _check_cache_implementation(self.model, record, kwargs)
        for name in CACHE_ARGUMENTS:  # a cache passed under either name reaches the model under its own
            if name != self.cache_name and kwargs.get(name) is not None:
                kwargs[self.cache_name] = kwargs.pop(name)
        generate = self.original or type(self.model).generate.__get__(self.model)
        try:
            return generate(*args, **kwargs)
        finally:
            cache = record.current or (record.last_cache() if record.last_cache else None)
            if cache is not None:
                record.last_report = cache.memory_report()
                _warn_over_budget(record, record.last_report)
            record.current = None

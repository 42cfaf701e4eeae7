"""Evaluation tasks, generated offline and seeded: needle, squad, ppl, and the RULER-style
set (:mod:`hqekv.eval.ruler`).

Each task makes :class:`Sample` s from the offline texts (``hqekv.texts``) and scores a
model on one sample through :func:`greedy_generate` or :func:`continuation_nll`, which
also time the prefill and the decode and return the cache for byte counting. Text used
for calibration (the first SQuAD articles) is never used here.
"""

from __future__ import annotations

import collections
import copy
import math
import random
import re
import statistics
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import texts
from ..cache import HqeKVCache
from ..patching import is_patched, new_cache, output_cache

CALIBRATION_ARTICLES = 4
"""SQuAD articles [0, 4) hold the 16K-token calibration text; evaluation uses the rest."""


@dataclass
class Sample:
    """One prompt: token ids (1, N), what a correct answer is, and how it was made."""

    id: str
    input_ids: torch.Tensor
    answers: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    continuation: torch.Tensor | None = None  # (1, L) for ppl


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _first_cache(cache) -> dict:
    """Keyword arguments that hand an initial cache (or none: the model makes its own) to the prefill."""
    return {} if cache is None else {"cache": cache}


def prefill(model, input_ids: torch.Tensor, cache=None, chunk: int | None = None):
    """The prompt (B, N) through the model into a cache, in one forward or in forwards of
    ``chunk`` tokens (as ``generate(prefill_chunk_size=chunk)`` feeds it); only the last
    position's logits are computed. ``cache``: an empty cache to use, else the model makes
    its own. -> the last forward's output (``logits`` (B, 1, V) and the cache)."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"prefill chunk of {chunk} tokens: it must be at least 1")
    step = input_ids.shape[1] if chunk is None else chunk
    if cache is None and step < input_ids.shape[1] and is_patched(model):
        cache = new_cache(model)
    if isinstance(cache, HqeKVCache) and step < input_ids.shape[1]:
        cache.defer_eviction()  # as generate does: evict once the whole prompt is in
    kwargs = _first_cache(cache)
    for start in range(0, input_ids.shape[1], step):
        out = model(input_ids[:, start : start + step], use_cache=True, logits_to_keep=1, **kwargs)
        kwargs = {"cache": output_cache(out)}
    if isinstance(kwargs["cache"], HqeKVCache):
        kwargs["cache"].settle()
    return out


@dataclass(frozen=True)
class Reference:
    """The answer whose NLL after the prompt a generating task records (``answer_nll``):
    ``tokens``, fp16's answer (token ids), or None for the answer generated here (fp16's
    own run). ``new_cache`` makes an empty cache of the method's kind (None: the model makes
    its own): the answer is scored on a copy of the cache the prefill left, and a cache that
    cannot be copied (transformers' quanto cache) is filled again from the prompt."""

    tokens: list[int] | None = None
    new_cache: Callable[[], object] = lambda: None


def greedy_generate(
    model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None, cache=None, prefill_chunk=None,
    reference: Reference | None = None,
):  # fmt: skip
    """Greedy decoding by hand, timing prefill and decode apart.

    input_ids (1, N) -> (new token ids (T,), prefill seconds, decode seconds, cache, answer NLL).
    Stops after ``max_new_tokens`` or at ``eos_token_id``. ``cache``: an empty cache to use
    (e.g. transformers' ``QuantizedCache``); by default the model makes its own.
    ``prefill_chunk``: feed the prompt in forwards of that many tokens (:func:`prefill`).
    ``reference``: the answer whose mean per-token NLL after the prompt to return
    (:class:`Reference`), its tokens fed one per forward as decoding feeds them, apart from
    the decode (which it does not touch, nor its timing); None: none (the last element is None).
    """
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    own = reference is not None and reference.tokens is None
    with torch.no_grad():
        _sync()
        start = time.perf_counter()
        out = prefill(model, input_ids, cache, prefill_chunk)
        _sync()
        prefill_s = time.perf_counter() - start
        cache = output_cache(out)
        first = out.logits[:, -1]
        scored = None if reference is None or own else _copied(cache)
        token = first.argmax(-1, keepdim=True)
        tokens, own_nll = [token], [_token_nll(first, token)] if own else []
        start = time.perf_counter()
        while len(tokens) < max_new_tokens and not (eos_token_id is not None and int(token) == eos_token_id):
            out = model(token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token)
            if own:
                own_nll.append(_token_nll(out.logits[:, -1], token))
        _sync()
        decode_s = time.perf_counter() - start
        answer_nll = None
        if own:
            answer_nll = statistics.fmean(own_nll)
        elif reference is not None:
            if scored is None:  # the cache cannot be copied: fill a new one from the prompt
                out = prefill(model, input_ids, reference.new_cache(), prefill_chunk)
                first, scored = out.logits[:, -1], output_cache(out)
            answer_nll = teacher_forced_nll(model, first, scored, reference.tokens)
    return torch.cat(tokens, 1)[0], prefill_s, decode_s, cache, answer_nll


def _copied(cache):
    """A copy of ``cache``, or None for one whose tensors cannot be copied (quanto's)."""
    try:
        return copy.deepcopy(cache)
    except RuntimeError:
        return None


def _token_nll(logits: torch.Tensor, token: torch.Tensor) -> float:
    """NLL of ``token`` (1, 1) under ``logits`` (1, V)."""
    return float(torch.nn.functional.cross_entropy(logits.float(), token[:, 0]))


def teacher_forced_nll(model, first_logits: torch.Tensor, cache, tokens) -> float:
    """Mean per-token NLL of ``tokens`` (ids) after a prompt: ``first_logits`` (1, V), the
    prompt's last logits, predict the first; the tokens then go through the model into
    ``cache`` (the prompt's, which they extend) one forward at a time, as in decoding."""
    if len(tokens) == 0:
        raise ValueError("the reference answer has no tokens to score")
    ids = torch.tensor([list(tokens)], device=first_logits.device)
    return float(nll_after(model, first_logits, cache, ids, step=1, feed_last=False).mean())


def nll_after(
    model, last: torch.Tensor, cache, continuation: torch.Tensor, step: int, feed_last: bool = True
) -> torch.Tensor:
    """Per-token NLL (L,) float32 of ``continuation`` (1, L) fed into ``cache`` in
    ``step``-token forwards, ``last`` (1, V) the logits before it (predicting its first token).
    ``feed_last=False`` leaves the last token out of the cache: nothing is scored after it."""
    fed = continuation if feed_last else continuation[:, :-1]
    nll = []
    for i in range(0, fed.shape[1], step):
        piece = fed[:, i : i + step]
        step_logits = model(piece, cache=cache, use_cache=True).logits
        logits = torch.cat([last[:, None], step_logits[:, :-1]], 1)
        nll.append(torch.nn.functional.cross_entropy(logits[0].float(), piece[0], reduction="none"))
        last = step_logits[:, -1]
    if not feed_last:  # the last token, scored by the logits before it
        nll.append(torch.nn.functional.cross_entropy(last.float(), continuation[0, -1:], reduction="none"))
    return torch.cat(nll)


def continuation_nll(
    model, context: torch.Tensor, continuation: torch.Tensor, step: int = 32, cache=None, prefill_chunk=None
):
    """Negative log-likelihood of ``continuation`` (1, L) after ``context`` (1, N) held in the cache.

    The continuation goes in ``step``-token forwards, so a compressed cache re-ranks between
    them as in decoding. -> (per-token NLL (L,) float32, prefill seconds, seconds of the
    continuation forwards, cache). ``cache`` and ``prefill_chunk`` as in :func:`greedy_generate`.
    """
    device = next(model.parameters()).device
    context, continuation = context.to(device), continuation.to(device)
    with torch.no_grad():
        _sync()
        start = time.perf_counter()
        out = prefill(model, context, cache, prefill_chunk)
        _sync()
        prefill_s = time.perf_counter() - start
        cache = output_cache(out)
        last = out.logits[:, -1]  # predicts the first continuation token
        start = time.perf_counter()
        nll = nll_after(model, last, cache, continuation, step)
        _sync()
        seconds = time.perf_counter() - start
    return nll, prefill_s, seconds, cache


# --- SQuAD answer scoring (the official normalization) -----------------------------------------


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    if not pred or not gold:
        return float(pred == gold)
    common = collections.Counter(pred) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def first_line(text: str) -> str:
    return text.strip().split("\n")[0].strip()


# --- tasks --------------------------------------------------------------------------------------


class Task:
    """A task: seeded samples, and one sample's score with its timings and cache."""

    name = ""
    higher_is_better = True
    metric = ""

    def samples(self, tokenizer, n: int, lengths: list[int], seed: int) -> list[Sample]:
        raise NotImplementedError

    def run(self, model, tokenizer, sample: Sample, cache=None, prefill_chunk=None, reference=None) -> tuple[dict, object]:
        """-> (per-sample record with ``score`` and timings, cache); ``cache``: an empty one to use;
        ``prefill_chunk``: the prompt goes in forwards of that many tokens (:func:`prefill`);
        ``reference``: for a generating task, the answer (:class:`Reference`) whose NLL after
        the prompt the record keeps as ``answer_nll`` (:func:`greedy_generate`)."""
        raise NotImplementedError


class NeedleTask(Task):
    """Pass key hidden in the essays at several lengths and depths; exact match of the key."""

    name, metric = "needle", "pass-key exact match"
    depths = (0.25, 0.5, 0.75, 0.9)
    max_new_tokens = 12

    def samples(self, tokenizer, n, lengths, seed):
        out = []
        for i in range(n):
            length, depth = lengths[i % len(lengths)], self.depths[(i // len(lengths)) % len(self.depths)]
            prompt, key = texts.passkey_prompt(tokenizer, length, depth=depth, seed=seed * 1000 + i)
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            out.append(Sample(f"needle-{i}", ids, [key], {"length": length, "depth": depth}))
        return out

    def run(self, model, tokenizer, sample, cache=None, prefill_chunk=None, reference=None):
        new, prefill_s, decode_s, cache, answer_nll = greedy_generate(
            model, sample.input_ids, self.max_new_tokens, tokenizer.eos_token_id, cache, prefill_chunk, reference
        )
        text = tokenizer.decode(new, skip_special_tokens=True)
        record = {"prediction": text, "score": float(sample.answers[0] in text)}
        return _timed(_answered(record, new, answer_nll), prefill_s, decode_s, len(new)), cache


class SquadTask(Task):
    """SQuAD v2 questions; the gold paragraph among paragraphs of other articles, to a length.

    Score: F1 against the gold answers (also EM, and agreement with the fp16 answer when the
    run includes fp16). Only articles not used for calibration are read.
    """

    name, metric = "squad", "F1"
    max_new_tokens = 24

    def samples(self, tokenizer, n, lengths, seed):
        articles = texts.squad_qa()[CALIBRATION_ARTICLES:]
        rng = random.Random(seed)
        questions = [(ai, pi, qa) for ai, a in enumerate(articles) for pi, (_, qas) in enumerate(a[1]) for qa in qas]
        out = []
        for i, (ai, pi, qa) in enumerate(rng.sample(questions, n)):
            length = lengths[i % len(lengths)]
            gold = articles[ai][1][pi][0]
            budget = length - len(tokenizer(gold, add_special_tokens=False).input_ids) - 80
            others = [p for aj, a in enumerate(articles) if aj != ai for p, _ in a[1]]
            rng.shuffle(others)
            filler = []
            for p in others:
                cost = len(tokenizer(p, add_special_tokens=False).input_ids)
                if cost > budget:
                    break
                filler.append(p)
                budget -= cost
            filler.insert(rng.randint(0, len(filler)), gold)
            document = "\n\n".join(filler)
            user = (
                "Answer the question using the document. Reply with a short answer only.\n\n"
                f"Document:\n{document}\n\nQuestion: {qa['question']}"
            )
            ids = tokenizer(texts.chat(tokenizer, user), return_tensors="pt", add_special_tokens=False).input_ids
            answers = [a["text"] for a in qa["answers"]]
            out.append(Sample(f"squad-{qa['id']}", ids, answers, {"length": length, "question": qa["question"]}))
        return out

    def run(self, model, tokenizer, sample, cache=None, prefill_chunk=None, reference=None):
        new, prefill_s, decode_s, cache, answer_nll = greedy_generate(
            model, sample.input_ids, self.max_new_tokens, tokenizer.eos_token_id, cache, prefill_chunk, reference
        )
        text = first_line(tokenizer.decode(new, skip_special_tokens=True))
        record = {
            "prediction": text,
            "score": max(f1_score(text, a) for a in sample.answers),
            "em": max(exact_match(text, a) for a in sample.answers),
        }
        return _timed(_answered(record, new, answer_nll), prefill_s, decode_s, len(new)), cache


class PerplexityTask(Task):
    """Perplexity of 256 tokens that follow a long context of unseen SQuAD articles."""

    name, metric, higher_is_better = "ppl", "perplexity", False
    continuation_tokens = 256

    def samples(self, tokenizer, n, lengths, seed):
        """Each sample's articles in a shuffled order, no two samples starting with the same
        article (an order that repeats a first article is shuffled again): a long article would
        otherwise make two samples one text."""
        articles = texts.squad_articles()[CALIBRATION_ARTICLES:]
        if n > len(articles):
            raise ValueError(f"ppl has {len(articles)} held-out articles to start samples with, {n} samples asked")
        rng = random.Random(seed)
        out, firsts = [], set()
        for i in range(n):
            length = lengths[i % len(lengths)]
            order = list(articles)
            rng.shuffle(order)
            while order[0][0] in firsts:
                rng.shuffle(order)
            firsts.add(order[0][0])
            ids, _ = texts.joined_tokens(tokenizer, order, length + self.continuation_tokens)
            ids = torch.tensor([ids])
            out.append(Sample(f"ppl-{i}", ids[:, :length], [], {"length": length}, ids[:, length:]))
        return out

    def run(self, model, tokenizer, sample, cache=None, prefill_chunk=None, reference=None):
        nll, prefill_s, seconds, cache = continuation_nll(
            model, sample.input_ids, sample.continuation, cache=cache, prefill_chunk=prefill_chunk
        )
        mean = float(nll.mean())
        record = {"nll": mean, "score": math.exp(mean)}
        return _timed(record, prefill_s, None, None), cache


def _answered(record: dict, new: torch.Tensor, answer_nll: float | None) -> dict:
    """``record`` with the generated token ids (``tokens``: the reference other methods'
    answers are scored against) and, when one was scored, ``answer_nll``."""
    record["tokens"] = new.tolist()
    if answer_nll is not None:
        record["answer_nll"] = answer_nll
    return record


def _timed(record: dict, prefill_s: float, decode_s: float | None, n_new: int | None) -> dict:
    record["prefill_s"] = prefill_s
    # the first new token comes from the prefill; the decode loop made the others
    steps = (n_new - 1) if n_new else 0
    record["decode_tokens_per_s"] = steps / decode_s if decode_s and steps else None
    return record


from .ruler import RULER_TASKS  # noqa: E402 (its tasks build on this module's Task)

TASKS = {t.name: t for t in (NeedleTask(), SquadTask(), PerplexityTask(), *RULER_TASKS)}

TASK_GROUPS = {"ruler": (*(t.name for t in RULER_TASKS), "squad")}
"""Names that stand for several tasks: ``ruler`` is the RULER-style set, its QA with
distractors being ``squad``."""


def expand_tasks(names) -> list[str]:
    """Task names with each group replaced by its tasks, each task once, in first-seen order."""
    return list(dict.fromkeys(t for name in names for t in TASK_GROUPS.get(name, (name,))))

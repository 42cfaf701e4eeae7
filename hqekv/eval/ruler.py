"""RULER-style tasks, generated offline from the essays: several needles, variable
tracking, common words.

After RULER (Hsieh et al., 2024, arXiv 2404.06654), so that figures can be read next to its
tables: the same kinds of task, templates and scoring (the share of the expected strings
the answer holds), made from the texts :mod:`hqekv.texts` installs. Its QA with distractors
is the ``squad`` task (a SQuAD paragraph among paragraphs of other articles).

- ``niah_multikey``: four "special magic number" needles under different keys, one asked for;
- ``niah_multivalue``: four numbers under one key, all asked for;
- ``vt``: a value passed along a chain of five variables spread through the text, every
  variable that holds it asked for;
- ``cwe``: a numbered list of words in which ten appear 30 times and the rest 3 times, the
  ten asked for.

Keys and values are seeded draws: 7-digit numbers, words of the essays (:func:`hqekv.texts.essay_words`).
Each prompt ends with the start of the answer (RULER's answer prefix), after the chat
turn's generation prompt.
"""

from __future__ import annotations

import random
import string

from .. import texts
from .tasks import Sample, Task, _answered, _timed, greedy_generate

NEEDLE_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)


def found(prediction: str, references: list[str]) -> list[bool]:
    """Which of ``references`` ``prediction`` holds (case-insensitive)."""
    text = prediction.lower()
    return [r.lower() in text for r in references]


def string_match_all(prediction: str, references: list[str]) -> float:
    """The share of ``references`` found in ``prediction``: RULER's score."""
    return sum(found(prediction, references)) / len(references)


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


class RulerTask(Task):
    """A RULER-style task: a seeded prompt per sample, scored by :func:`string_match_all`."""

    metric = "share of the expected strings in the answer"
    max_new_tokens = 32

    def make(self, tokenizer, length: int, rng: random.Random) -> tuple[str, str, list[str], dict]:
        """-> (user turn, answer prefix, expected strings, what to record) for about ``length`` tokens."""
        raise NotImplementedError

    def samples(self, tokenizer, n, lengths, seed):
        out = []
        for i in range(n):
            length = lengths[i % len(lengths)]
            rng = random.Random(f"{self.name}-{seed}-{i}")
            user, prefix, answers, meta = self.make(tokenizer, length, rng)
            prompt = texts.chat(tokenizer, user) + prefix
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            out.append(Sample(f"{self.name}-{i}", ids, answers, {"length": length, **meta}))
        return out

    def run(self, model, tokenizer, sample, cache=None, prefill_chunk=None, reference=None):
        new, prefill_s, decode_s, cache, answer_nll = greedy_generate(
            model, sample.input_ids, self.max_new_tokens, tokenizer.eos_token_id, cache, prefill_chunk, reference
        )
        text = tokenizer.decode(new, skip_special_tokens=True).strip()
        hits = found(text, sample.answers)
        # agreement with fp16 compares what was found, not the wording around it
        record = {"prediction": text, "score": sum(hits) / len(hits), "found": hits}
        return _timed(_answered(record, new, answer_nll), prefill_s, decode_s, len(new)), cache


def _depths(rng: random.Random, n: int) -> list[float]:
    return [rng.uniform(0.05, 0.95) for _ in range(n)]


def _needles_in_essays(
    tokenizer, length: int, rng: random.Random, intro: str, needles: list[str], depths: list[float], question: str
) -> str:
    """The user turn: ``intro``, essay text with the needles at their depths, ``question``;
    about ``length`` tokens in all."""
    overhead = _tokens(tokenizer, f"{intro}\n\n\n\n{question}") + sum(_tokens(tokenizer, n) + 2 for n in needles)
    hay = texts.haystack_with_needles(
        tokenizer, max(32, length - overhead), needles, depths, offset=rng.randint(0, 100_000)
    )
    return f"{intro}\n\n{hay}\n\n{question}"


class MultiKeyNeedleTask(RulerTask):
    """Four needles under different keys; the number of one of them (RULER's niah_multikey_1)."""

    name = "niah_multikey"
    keys = 4
    max_new_tokens = 16

    def make(self, tokenizer, length, rng):
        keys = rng.sample(texts.essay_words(), self.keys)
        values = [_number(rng) for _ in keys]
        asked = rng.randrange(self.keys)
        needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
        question = f"What is the special magic number for {keys[asked]} mentioned in the provided text?"
        user = _needles_in_essays(tokenizer, length, rng, NEEDLE_INTRO, needles, _depths(rng, len(needles)), question)
        prefix = f" The special magic number for {keys[asked]} mentioned in the provided text is"
        return user, prefix, [values[asked]], {"key": keys[asked], "distractors": self.keys - 1}


class MultiValueNeedleTask(RulerTask):
    """Four numbers under one key; all of them (RULER's niah_multivalue)."""

    name = "niah_multivalue"
    values = 4
    max_new_tokens = 48

    def make(self, tokenizer, length, rng):
        key = rng.choice(texts.essay_words())
        values = [_number(rng) for _ in range(self.values)]
        needles = [f"One of the special magic numbers for {key} is: {v}." for v in values]
        question = f"What are all the special magic numbers for {key} mentioned in the provided text?"
        user = _needles_in_essays(tokenizer, length, rng, NEEDLE_INTRO, needles, _depths(rng, len(needles)), question)
        prefix = f" The special magic numbers for {key} mentioned in the provided text are"
        return user, prefix, values, {"key": key}


class VariableTrackingTask(RulerTask):
    """A value assigned to one variable and passed along a chain of five, each assignment a
    needle in the essays; every variable that holds the value (RULER's vt, one chain)."""

    name = "vt"
    hops = 4
    max_new_tokens = 32

    def make(self, tokenizer, length, rng):
        names: list[str] = []
        while len(names) < self.hops + 1:  # distinct five-letter names
            name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if name not in names:
                names.append(name)
        value = str(rng.randint(10_000, 99_999))
        needles = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        intro = "Memorize and track the chain(s) of variable assignment hidden in the following text."
        question = f"Question: Find all variables that are assigned the value {value} in the text above."
        depths = sorted(_depths(rng, len(needles)))  # the chain in reading order
        user = _needles_in_essays(tokenizer, length, rng, intro, needles, depths, question)
        prefix = f" According to the chain(s) of variable assignment in the text above, {self.hops + 1} variables are assigned the value {value}, they are:"
        return user, prefix, names, {"value": value}


class CommonWordsTask(RulerTask):
    """A numbered list of words: ten appear 30 times each, the others 3 times; the ten
    (RULER's cwe). The list is as long as the prompt's length allows."""

    name = "cwe"
    common, common_freq, rare_freq = 10, 30, 3
    max_new_tokens = 64

    def make(self, tokenizer, length, rng):
        intro = (
            "Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often."
        )
        question = f"Question: What are the {self.common} most common words in the above list?"
        words = list(texts.essay_words())
        rng.shuffle(words)
        common, pool = words[: self.common], words[self.common :]
        budget = length - _tokens(tokenizer, f"{intro}\n\n{question}")
        # one list entry costs about the tokens of "123. word\n"; the common words take at most
        # a third of the list (fewer than 30 times each in a short prompt, never as few as the rare)
        entry = _tokens(tokenizer, "123. " + common[0] + "\n")
        freq = max(self.rare_freq + 1, min(self.common_freq, budget // entry // (3 * self.common)))
        n_rare = min(len(pool), max(0, (budget // entry - self.common * freq) // self.rare_freq))

        def numbered_list(n_rare: int) -> str:
            listed = common * freq + pool[:n_rare] * self.rare_freq
            random.Random(f"{self.name}-order-{n_rare}-{rng.random()}").shuffle(listed)
            return "".join(f"{i + 1}. {w}\n" for i, w in enumerate(listed))

        numbered = numbered_list(n_rare)
        while n_rare and _tokens(tokenizer, numbered) > budget:
            n_rare = int(n_rare * 0.9)  # words longer than the first: fewer of them
            numbered = numbered_list(n_rare)
        prefix = f" The top {self.common} words that appear most often in the list are:"
        return f"{intro}\n\n{numbered}\n{question}", prefix, common, {"common_freq": freq, "rare_words": n_rare}


RULER_TASKS = (MultiKeyNeedleTask(), MultiValueNeedleTask(), VariableTrackingTask(), CommonWordsTask())

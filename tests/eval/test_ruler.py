"""The RULER-style tasks: what each prompt holds, its scoring, and the ``ruler`` group."""

import collections
import re

import pytest

from hqekv.texts import haystack_with_needle, haystack_with_needles
from hqekv.eval.ruler import RULER_TASKS, string_match_all
from hqekv.eval.runner import check_request
from hqekv.eval.tasks import TASKS, expand_tasks

LENGTHS = [1024, 2048]


def test_string_match_all_is_the_share_of_references_found():
    assert string_match_all("They are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("ABCDE, fghij", ["abcde", "FGHIJ"]) == 1.0
    assert string_match_all("", ["1"]) == 0.0


def test_several_needles_go_in_at_their_depths_in_reading_order(smollm2):
    _, tok = smollm2
    one = haystack_with_needle(tok, 400, "NEEDLE-A", 0.5, offset=77)
    assert haystack_with_needles(tok, 400, ["NEEDLE-A"], [0.5], offset=77) == one  # the single needle unchanged
    text = haystack_with_needles(tok, 400, ["N-1", "N-2", "N-3"], [0.8, 0.2, 0.5], offset=77)
    assert text.index("N-2") < text.index("N-3") < text.index("N-1")
    assert len(text) == len(one) - len("NEEDLE-A") + sum(len(n) for n in ("N-1", "N-2", "N-3")) + 4  # 2 spaces each
    with pytest.raises(ValueError, match="2 needles for 1 depths"):
        haystack_with_needles(tok, 400, ["a", "b"], [0.5])


@pytest.fixture(scope="module")
def samples(smollm2):
    _, tok = smollm2
    return tok, {t.name: t.samples(tok, 4, LENGTHS, seed=3) for t in RULER_TASKS}


def test_each_prompt_holds_what_its_answer_needs_at_about_its_length(samples):
    tok, by_task = samples
    for name, task_samples in by_task.items():
        for s in task_samples:
            n, length = s.input_ids.shape[1], s.meta["length"]
            assert 0.9 * length <= n <= length + 120, (name, n, length)
            text = tok.decode(s.input_ids[0])
            body = text[: text.rindex("\n\n")]  # the question and the answer's start come after the text
            if name == "niah_multikey":
                assert len(re.findall(r"One of the special magic numbers for \w+ is: \d{7}\.", body)) == 4
                assert f"for {s.meta['key']} is: {s.answers[0]}." in body
            elif name == "niah_multivalue":
                assert [v for v in s.answers if f"for {s.meta['key']} is: {v}." in body] == s.answers
            elif name == "vt":
                chain = [f"VAR {s.answers[0]} = {s.meta['value']}."]
                chain += [f"VAR {b} = VAR {a}." for a, b in zip(s.answers, s.answers[1:])]
                positions = [body.index(c) for c in chain]
                assert positions == sorted(positions)  # assignments in reading order
            elif name == "cwe":
                counts = collections.Counter(re.findall(r"^\d+\. (\w+)$", body, flags=re.M))
                assert {w: counts[w] for w in s.answers} == {w: s.meta["common_freq"] for w in s.answers}
                assert s.meta["common_freq"] > 3 and max(c for w, c in counts.items() if w not in s.answers) == 3
            assert text.rstrip().endswith(("is", "are", "are:")), text[-80:]  # the answer's start, RULER's prefix


def test_samples_are_seeded_and_differ_between_samples(samples):
    tok, by_task = samples
    for task in RULER_TASKS:
        again = task.samples(tok, 4, LENGTHS, seed=3)
        assert [s.input_ids.tolist() for s in again] == [s.input_ids.tolist() for s in by_task[task.name]]
        assert len({tuple(s.answers) for s in again}) == 4, task.name
    other = RULER_TASKS[0].samples(tok, 1, LENGTHS, seed=4)[0]
    assert other.input_ids.tolist() != by_task[RULER_TASKS[0].name][0].input_ids.tolist()


def test_ruler_names_the_set_and_unknown_tasks_are_refused_before_any_run():
    assert expand_tasks(["needle", "ruler", "squad"]) == ["needle", "niah_multikey", "niah_multivalue", "vt", "cwe", "squad"]
    assert all(name in TASKS for name in expand_tasks(["ruler"]))
    check_request(["fp16"], ["ruler"], 1, [256])
    with pytest.raises(ValueError, match="unknown tasks \\['rulers'\\].*ruler"):
        check_request(["fp16"], ["rulers"], 1, [256])


def test_agreement_with_fp16_compares_the_strings_found_not_the_wording():
    from hqekv.eval.runner import summarize

    def record(method, index, found, prediction):
        return {"task": "niah_multivalue", "index": index, "method": method, "found": found, "prediction": prediction,
                "score": sum(found) / len(found), "cache_bytes": 1, "effective_bits": 1.0, "bavg": 1.0,
                "prefill_s": 1.0, "ratios_source": None, "ratios": None}  # fmt: skip

    records = [
        record("fp16", 0, [True, True, False, False], "1 and 2."),
        record("fp16", 1, [True, False, False, False], "1"),
        record("m", 0, [True, True, False, False], "They are 1, then 2"),  # other words, the same found
        record("m", 1, [False, True, False, False], "2"),  # two of four differ
    ]
    rows = {r["method"]: r for r in summarize(records)}
    assert rows["fp16"]["agreement_with_fp16"] == 1.0
    assert rows["m"]["agreement_with_fp16"] == pytest.approx((1.0 + 0.5) / 2)

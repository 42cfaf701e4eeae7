"""Memory reports: every stored byte counted, per request and per thread, and a budget the prompt is too short for."""

import warnings

import pytest
import torch

import hqekv
from hqekv.patching import output_cache

from .helpers import MIXED, greedy, prompt, stored_bytes


def test_memory_report_counts_every_stored_byte(tiny):
    hqekv.patch_model(tiny, ratios=MIXED, value_group=16)
    with torch.no_grad():
        out = tiny.generate(prompt(300), max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    cache = output_cache(out)
    report = hqekv.memory_report(cache)
    stored = stored_bytes(cache)
    assert report.total_bytes == stored
    assert hqekv.memory_report(tiny).total_bytes == stored  # the model reports its last cache
    assert 0 < report.ratio_to_fp16 < 1 and report.effective_bits > report.bavg > 0
    assert report.chunks["evicted"] > 0
    assert "MiB" in str(report)


def test_memory_report_after_plain_generate(tiny):
    hqekv.patch_model(tiny, ratios=MIXED, value_group=16)
    with pytest.raises(ValueError, match="not run"):
        hqekv.memory_report(tiny)
    greedy(tiny, prompt(200), 3)
    report = hqekv.memory_report(tiny)
    assert report.chunks["real_tokens"] == 202


def test_a_short_prompt_far_over_the_requested_bavg_warns_once_and_reports_it(tiny):
    hqekv.patch_model(tiny, ratios=MIXED, value_group=16)
    with pytest.warns(UserWarning, match="protected FP16 chunks") as caught:
        greedy(tiny, prompt(60), 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per patched model, not per request
        greedy(tiny, prompt(60), 3)
    assert sum("protected FP16" in str(w.message) for w in caught) == 1
    report = hqekv.memory_report(tiny)
    assert report.requested_bavg == MIXED.bavg and report.over_budget > 1
    assert "above the requested bavg" in str(report)
    long = hqekv.memory_report(output_cache(tiny.generate(prompt(1200), max_new_tokens=2, return_dict_in_generate=True)))
    assert long.over_budget < 1 and "above the requested" not in str(long)


def test_memory_report_of_the_model_is_per_thread(tiny):
    import threading

    hqekv.patch_model(tiny, ratios=MIXED, value_group=16)
    reports, barrier = {}, threading.Barrier(2)

    def run(n_prompt, n_new):
        barrier.wait()
        greedy(tiny, prompt(n_prompt, seed=n_prompt), n_new)
        barrier.wait()  # both finished before either reads its report
        reports[n_prompt] = hqekv.memory_report(tiny).chunks["real_tokens"]

    threads = [threading.Thread(target=run, args=a) for a in ((500, 200), (300, 20))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reports == {500: 500 + 199, 300: 300 + 19}
    with pytest.raises(ValueError, match="not run"):  # this thread ran nothing
        hqekv.memory_report(tiny)

"""hqekv eval: every method × task on SmolLM2 at short lengths, results files, sharding."""

import json
import math
import os

import pytest
from filelock import FileLock

from hqekv.eval import evaluate, parse_method, summarize, write_results
from hqekv.eval.methods import Method
from hqekv.eval.runner import baseline_at, equal_bytes_comparison, plot, plot_cap
from hqekv.eval.tasks import TASKS, exact_match, f1_score

METHODS = ["fp16", "hqekv:16", "kivi:2", "evict:2", "hqekv:2", "random:2", "quanto:2", "quanto:4"]
"""One method of each kind the tests of the run below read: the run is the suite's longest."""
LENGTHS = [384]


def test_parse_method():
    assert parse_method("fp16") == Method("fp16")
    assert parse_method("kivi:2") == Method("kivi", 2.0)
    assert parse_method("hqekv:3.2").name == "hqekv:3.2"
    assert parse_method("quanto:4") == Method("quanto", 4.0) and parse_method("random:2").name == "random:2"
    assert parse_method("paper:3.2") == Method("paper", 3.2) and parse_method("rkivi:4").name == "rkivi:4"
    assert parse_method("calibrated:2") == Method("calibrated", 2.0)
    for bad in ["fp8", "kivi:3", "rkivi:3", "kivi", "fp16:2", "evict:16", "hqekv:0", "hqekv:x", "quanto:3", "quanto",
                "random", "paper", "hqekv-foo:2"]:
        with pytest.raises(ValueError):
            parse_method(bad)


def test_equal_memory_settings():
    kivi = parse_method("kivi:2").patch_kwargs()
    assert kivi["ratios"].int2 == 1.0 and kivi["protected_chunks"] == 0
    evict = parse_method("evict:2").patch_kwargs()
    # full-precision chunks cost 16 bits whatever the model dtype; kivi:2 costs 2 + 0.75 metadata bits
    assert evict["ratios"].fp16 == pytest.approx(2.75 / 16) and evict["eviction"] == "key"
    assert parse_method("fp16").patch_kwargs() is None and parse_method("quanto:2").patch_kwargs() is None
    assert parse_method("random:3.2").patch_kwargs() == {"bavg": 3.2, "ratios": "calibrated", "importance": "random"}
    assert parse_method("calibrated:2").patch_kwargs() == {"bavg": 2.0, "ratios": "calibrated"}
    # the published baselines are unrotated; rkivi is the rotated tier alone
    assert kivi["rotation"] is None and evict["rotation"] is None
    assert parse_method("rkivi:2").patch_kwargs()["rotation"] == "hadamard"
    assert parse_method("paper:2").patch_kwargs() == {"bavg": 2.0, "rotation": None}
    assert parse_method("rhqekv:2").patch_kwargs() == {"bavg": 2.0, "rotation": "hadamard"}


def test_baselines_are_interpolated_at_equal_bytes():
    kivi = [(3.0, 24.0), (5.0, 20.0)]  # (effective bits, perplexity)
    assert baseline_at(kivi, 4.0) == pytest.approx(22.0)
    assert baseline_at(kivi, 6.0) == 20.0  # past its last point: that point
    assert baseline_at(kivi, 2.5) is None  # it cannot be run that small
    rows = [
        {"task": "ppl", "method": m, "effective_bits": b, "score": p, "higher_is_better": False}
        for m, b, p in [("kivi:2", 3.0, 24.0), ("kivi:4", 5.0, 20.0), ("hqekv:2", 2.9, 23.0), ("hqekv:3.2", 4.0, 22.5)]
    ]
    got = {(c["method"], c["baseline"]): c for c in equal_bytes_comparison(rows)}
    assert set(got) == {("hqekv:2", "kivi"), ("hqekv:3.2", "kivi")}
    assert got[("hqekv:2", "kivi")]["wins"] and got[("hqekv:2", "kivi")]["baseline_score"] is None
    assert not got[("hqekv:3.2", "kivi")]["wins"] and got[("hqekv:3.2", "kivi")]["baseline_score"] == pytest.approx(22.0)


def test_squad_scoring():
    assert f1_score("The Eiffel Tower!", "eiffel tower") == 1.0
    assert exact_match("the Tower", "Tower.") == 1.0
    assert f1_score("Paris France", "Paris") == pytest.approx(2 / 3)
    assert f1_score("", "Paris") == 0.0


def test_samples_are_seeded_and_exclude_calibration_text(smollm2):
    _, tok = smollm2
    from hqekv.texts import calibration_text, squad_articles

    calibration = set(calibration_text(tok, 16384, 128).articles)
    for name, task in TASKS.items():
        a = task.samples(tok, 3, [256, 384], seed=1)
        b = task.samples(tok, 3, [256, 384], seed=1)
        assert [s.input_ids.tolist() for s in a] == [s.input_ids.tolist() for s in b]
        assert all(s.input_ids.shape[1] <= 384 + 200 for s in a), name
    used = TASKS["squad"].samples(tok, 6, [384], seed=0) + TASKS["ppl"].samples(tok, 4, [384], seed=0)
    eval_text = " ".join(tok.decode(s.input_ids[0]) for s in used)
    leaked = [
        title
        for title, text in squad_articles()
        if title in calibration
        for paragraph in text.split("\n\n")
        if paragraph[:80] in eval_text
    ]
    assert not leaked, f"calibration articles leaked into evaluation prompts: {sorted(set(leaked))}"
    assert any(p[:80] in eval_text for t, text in squad_articles() if t not in calibration for p in text.split("\n\n"))


def test_no_two_perplexity_samples_are_one_text(smollm2):
    _, tok = smollm2
    # seed 2 shuffles the same long article first for its first two samples
    samples = TASKS["ppl"].samples(tok, 6, [512], seed=2)
    starts = {tuple(s.input_ids[0, :64].tolist()) for s in samples}
    assert len(starts) == 6
    with pytest.raises(ValueError, match="held-out articles"):
        TASKS["ppl"].samples(tok, 40, [512], seed=0)


@pytest.fixture(scope="module", autouse=True)
def short_continuations():
    """The perplexity task scores 64 continuation tokens in this module instead of 256 (two
    32-token forwards instead of eight), the same in every run of it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TASKS["ppl"], "continuation_tokens", 64)
        yield


@pytest.fixture(scope="module")
def run(smollm2, tmp_path_factory):
    """The evaluation the tests below read. Under ``pytest -n N`` the first worker to need it
    builds it and the others read its records (a file of this run's temporary directory),
    instead of each worker building it again."""
    model, tok = smollm2

    def build():
        return evaluate(model, tok, METHODS, ["needle", "squad", "ppl"], samples=2, lengths=LENGTHS, progress=False)

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build()
    shared = tmp_path_factory.getbasetemp().parent / "smollm2-eval-run.json"  # one per pytest run
    with FileLock(f"{shared}.lock"):
        if not shared.is_file():
            shared.write_text(json.dumps(build()))
        return json.loads(shared.read_text())


def test_every_method_and_task_gives_well_formed_results(run, tmp_path):
    assert len(run) == len(METHODS) * 3 * 2
    payload = write_results(run, tmp_path, {"model_id": "smollm2", "command": "hqekv eval ..."})
    data = json.loads((tmp_path / "results.json").read_text())
    assert data == json.loads(json.dumps(payload))
    assert len(data["summary"]) == len(METHODS) * 3
    for row in data["summary"]:
        assert row["samples"] == 2 and math.isfinite(row["score"]) and row["cache_bytes"] > 0
        assert row["prefill_s"] > 0 and 0 < row["effective_bits"] <= 64
        if row["task"] != "ppl":
            assert row["decode_tokens_per_s"] is None or row["decode_tokens_per_s"] > 0
            assert 0 <= row["score"] <= 1 and "agreement_with_fp16" in row
    table = (tmp_path / "results.md").read_text()
    for m in METHODS:
        assert f"| {m} |" in table
    for task in ("needle", "squad", "ppl"):
        png = tmp_path / f"{task}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fp16_and_all_fp16_hqekv_score_identically(run):
    by = {(r["task"], r["method"], r["index"]): r for r in run}
    for (task, method, index), r in by.items():
        if method != "hqekv:16":
            continue
        ref = by[(task, "fp16", index)]
        assert r["ratios"].startswith("fp16=1")
        if task == "ppl":
            assert r["score"] == pytest.approx(ref["score"], rel=1e-4)
        else:
            assert r["prediction"] == ref["prediction"] and r["score"] == ref["score"]


def test_generating_tasks_score_fp16s_answer_under_every_method(run):
    """Each generating record keeps its tokens and the NLL of fp16's answer under its cache;
    an all-FP16 hqekv cache holds what fp16's does (rounded to float16, where the fp16
    method keeps the float32 model's values), so its answer NLL is fp16's to that rounding."""
    by = {(r["task"], r["method"], r["index"]): r for r in run}
    rows = {(r["task"], r["method"]): r for r in summarize(run)}
    for (task, method, index), r in by.items():
        if task == "ppl":
            assert "answer_nll" not in r and "answer_nll_deviation_from_fp16" not in rows[(task, method)]
            continue
        assert r["tokens"] and math.isfinite(r["answer_nll"]) and r["answer_nll"] >= 0
        if method == "hqekv:16":
            assert r["answer_nll"] == pytest.approx(by[(task, "fp16", index)]["answer_nll"], abs=1e-3)
        assert rows[(task, method)]["answer_nll_deviation_from_fp16"] >= 0
    assert all(rows[(t, "fp16")]["answer_nll_deviation_from_fp16"] == 0 for t in ("needle", "squad"))
    assert any(rows[(t, "kivi:2")]["answer_nll_deviation_from_fp16"] > 0 for t in ("needle", "squad"))


def test_answer_nll_is_the_nll_of_a_forward_over_prompt_and_answer(tiny, monkeypatch):
    """Teacher-forced token by token on a copy of the prefill's cache, the reference answer's
    NLL is that of one forward over prompt and answer; the generation beside it is untouched,
    and a run's own answer (``Reference()``) scores as that answer given as the reference."""
    import torch

    from hqekv.eval.tasks import Reference, greedy_generate

    from ..helpers import prompt

    ids, answer = prompt(50, seed=1), [5, 17, 99, 3]
    with torch.no_grad():
        logits = tiny(torch.cat([ids, torch.tensor([answer])], 1)).logits[0, ids.shape[1] - 1 : -1].float()
    expected = float(torch.nn.functional.cross_entropy(logits, torch.tensor(answer)))
    plain = greedy_generate(tiny, ids, 6)
    new, _, _, _, nll = greedy_generate(tiny, ids, 6, reference=Reference(answer))
    assert nll == pytest.approx(expected, rel=1e-5) and plain[4] is None
    assert torch.equal(new, plain[0])
    own = greedy_generate(tiny, ids, 6, reference=Reference())
    assert torch.equal(own[0], plain[0])
    assert own[4] == pytest.approx(greedy_generate(tiny, ids, 6, reference=Reference(plain[0].tolist()))[4], rel=1e-5)
    with pytest.raises(ValueError, match="no tokens"):
        greedy_generate(tiny, ids, 2, reference=Reference([]))
    # a cache that cannot be copied (quanto's) is filled again from the prompt to score the answer
    monkeypatch.setattr("hqekv.eval.tasks._copied", lambda cache: None)
    new, _, _, _, nll = greedy_generate(tiny, ids, 6, reference=Reference(answer))
    assert nll == pytest.approx(expected, rel=1e-5) and torch.equal(new, plain[0])


@pytest.mark.parametrize("length, step", [(7, 1), (7, 3), (6, 3), (1, 1)])
def test_nll_after_can_leave_the_last_token_unfed_and_scores_the_same(tiny, length, step):
    """Scoring a continuation needs no forward over its last token (nothing is scored after
    it): without it the NLL is the same, one forward fewer where the last piece is one token,
    and the cache ends a token shorter."""
    import torch
    from transformers import DynamicCache

    from hqekv.eval.tasks import nll_after

    from ..helpers import prompt

    ids, continuation = prompt(40, seed=2), prompt(length, seed=3)
    calls = []
    hook = tiny.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        runs = {}
        for feed_last in (True, False):
            cache = DynamicCache()
            with torch.no_grad():
                last = tiny(ids, cache=cache, use_cache=True).logits[:, -1]
                calls.clear()
                nll = nll_after(tiny, last, cache, continuation, step, feed_last=feed_last)
            runs[feed_last] = nll, len(calls), cache.get_seq_length()
    finally:
        hook.remove()
    (full, full_calls, full_len), (short, short_calls, short_len) = runs[True], runs[False]
    torch.testing.assert_close(short, full, rtol=1e-5, atol=1e-6)
    assert short.shape == (length,)
    assert full_len == 40 + length and short_len == 40 + length - 1
    last_piece_is_one_token = (length - 1) % step == 0
    assert full_calls == -(-length // step) and short_calls == full_calls - last_piece_is_one_token


def test_answer_nll_rows_need_fp16s_answer():
    def record(method, index, answer_nll):
        return {"task": "squad", "method": method, "index": index, "prediction": "a", "score": 1.0, "em": 1.0,
                "cache_bytes": 1, "effective_bits": 3.0, "bavg": 2.0, "prefill_s": 1.0, "ratios_source": None,
                "ratios": None, **({} if answer_nll is None else {"answer_nll": answer_nll})}  # fmt: skip

    records = [record("fp16", 0, 0.5), record("fp16", 1, 0.2), record("m", 0, 0.7), record("m", 1, 0.1)]
    rows = {r["method"]: r for r in summarize(records)}
    assert rows["m"]["answer_nll_deviation_from_fp16"] == pytest.approx(0.15)
    assert rows["fp16"]["answer_nll_deviation_from_fp16"] == 0.0
    old = [record("fp16", 0, None)] + records[2:3]  # an fp16 record made before answers were scored
    assert "answer_nll_deviation_from_fp16" not in summarize(old)[1]


def test_random_control_has_the_tier_counts_of_hqekv(run):
    """random:B keeps hqekv:B's ratios; before any re-rank (a needle answer at 384 tokens) its
    bytes too. Re-ranks during a continuation may then move different chunks down."""
    rows = {(r["task"], r["method"]): r for r in summarize(run)}
    for task in ("needle", "squad", "ppl"):
        hq, rnd = rows[(task, "hqekv:2")], rows[(task, "random:2")]
        assert rnd["ratios"] == hq["ratios"] and rnd["ratios_source"] == hq["ratios_source"]
    assert rows[("needle", "random:2")]["cache_bytes"] == rows[("needle", "hqekv:2")]["cache_bytes"]


def test_quanto_anchor_counts_its_codes_and_residual(run):
    """quanto:B is transformers' QuantizedCache: fewer bytes at 2 bits than at 4, both below the dense cache."""
    rows = {(r["task"], r["method"]): r for r in summarize(run)}
    for task in ("needle", "ppl"):
        q2, q4, fp16 = (rows[(task, m)]["cache_bytes"] for m in ("quanto:2", "quanto:4", "fp16"))
        assert q2 < q4 < fp16
        assert rows[(task, "quanto:2")]["ratios_source"] is None  # not patched


def test_compressed_methods_store_less_than_fp16(run):
    rows = {(r["task"], r["method"]): r for r in summarize(run)}
    for task in ("needle", "squad", "ppl"):
        fp16 = rows[(task, "fp16")]["cache_bytes"]
        # at ~400 tokens the protected full-precision chunks and the tail weigh a lot: only "less"
        for m in ("kivi:2", "evict:2", "hqekv:2"):
            assert rows[(task, m)]["cache_bytes"] < fp16, (task, m)
        assert rows[(task, "kivi:2")]["effective_bits"] < rows[(task, "hqekv:16")]["effective_bits"]


def test_shards_merge_into_the_one_process_run(smollm2, run):
    model, tok = smollm2
    methods = ["fp16", "hqekv:2"]
    shards = [
        r
        for rank in range(2)
        for r in evaluate(model, tok, methods, ["needle", "ppl"], samples=2, lengths=LENGTHS, shard=(rank, 2), progress=False)
    ]
    whole = [r for r in run if r["method"] in methods and r["task"] in ("needle", "ppl")]
    key = lambda r: (r["task"], r["method"], r["index"])  # noqa: E731
    fields = ("score", "cache_bytes", "effective_bits", "prediction", "sample")
    assert [[r.get(f) for f in fields] for r in sorted(shards, key=key)] == [
        [r.get(f) for f in fields] for r in sorted(whole, key=key)
    ]


def test_cli_eval_rejects_a_bad_method_before_loading(capsys):
    from hqekv.cli import main

    assert main(["eval", "--model", "smollm2", "--methods", "fp8", "--out", "/tmp/unused"]) == 2
    assert "unknown method" in capsys.readouterr().err


def test_results_of_methods_no_parser_knows_are_still_written(tmp_path):
    """An ablation variant's name is not a method spec: sorting and writing keep it as it is."""
    from hqekv.eval.runner import sort_records

    records = [
        {"task": "ppl", "method": m, "index": i, "score": 15.0 + i, "nll": 2.7, "effective_bits": 3.0, "cache_bytes": 10,
         "elements": 10, "bavg": 2.0, "length": 384, "prefill_s": 1.0, "ratios_source": None, "ratios": None}
        for m in ("asymrot:2", "kivi:2") for i in range(2)
    ]  # fmt: skip
    ordered = sort_records(records, methods=["kivi:2.0", "asymrot:2"])  # the order as a run lists its specs
    assert [r["method"] for r in ordered] == ["kivi:2", "kivi:2", "asymrot:2", "asymrot:2"]
    write_results(records, tmp_path, {"methods": ["kivi:2", "asymrot:2"], "tasks": ["ppl"]})
    assert "asymrot:2" in (tmp_path / "results.md").read_text()


def test_cli_eval_loads_the_dtype_asked_and_records_it():
    import argparse

    import torch

    from hqekv.cli import build_parser, eval_settings, model_dtype

    args = build_parser().parse_args(["eval", "--model", "smollm2", "--dtype", "bfloat16", "--out", "o"])
    assert model_dtype(args) is torch.bfloat16
    assert model_dtype(build_parser().parse_args(["eval", "--model", "smollm2", "--out", "o"])) is None
    settings = eval_settings(args, "m", argparse.Namespace(dtype=torch.bfloat16))
    assert settings["model_dtype"] == "torch.bfloat16" and settings["command"].endswith("--dtype bfloat16")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--model", "smollm2", "--dtype", "int8", "--out", "o"])


def test_perplexity_rows_report_the_per_sample_distance_from_fp16():
    """Two samples off by +0.1 and -0.1 nats pool to fp16's perplexity but are 0.1 nats away."""
    def record(method, index, nll):
        return {"task": "ppl", "method": method, "index": index, "nll": nll, "score": math.exp(nll), "cache_bytes": 1,
                "effective_bits": 3.0, "bavg": 2.0, "prefill_s": 1.0, "ratios_source": None, "ratios": None}

    records = [record("fp16", 0, 2.0), record("fp16", 1, 3.0), record("hqekv:2", 0, 2.1), record("hqekv:2", 1, 2.9),
               record("kivi:2", 0, 2.0)]  # fmt: skip
    rows = {r["method"]: r for r in summarize(records)}
    assert rows["hqekv:2"]["score"] == pytest.approx(rows["fp16"]["score"])
    assert rows["hqekv:2"]["nll_deviation_from_fp16"] == pytest.approx(0.1)
    assert rows["fp16"]["nll_deviation_from_fp16"] == 0.0 and rows["kivi:2"]["nll_deviation_from_fp16"] == 0.0
    without_reference = summarize([r for r in records if r["method"] != "fp16"])
    assert all("nll_deviation_from_fp16" not in r for r in without_reference)


def test_plots_cut_a_collapsed_perplexity_and_keep_scores_that_rise():
    def row(method, bits, score, higher=False):
        return {"task": "ppl", "method": method, "effective_bits": bits, "score": score, "metric": "perplexity",
                "higher_is_better": higher}  # fmt: skip

    ppl = [row("fp16", 32, 18.0), row("quanto:2", 3.0, 137.0), row("kivi:2", 3.2, 22.8), row("hqekv:2", 3.2, 18.1)]
    assert plot_cap(ppl) == 36.0
    assert plot_cap([dict(r, higher_is_better=True) for r in ppl]) is None  # a score that rises is never cut
    assert plot_cap(ppl[1:]) is None  # no fp16 reference: nothing to cut at


def test_plot_writes_one_png_per_task_with_an_off_scale_point(tmp_path):
    rows = [{"task": "ppl", "method": m, "effective_bits": b, "score": s, "metric": "perplexity",
             "higher_is_better": False} for m, b, s in (("fp16", 32, 18.0), ("quanto:2", 3.0, 137.0), ("quanto:4", 5.0, 18.2))]  # fmt: skip
    written = plot(rows, tmp_path)
    assert [p.name for p in written] == ["ppl.png"] and written[0].stat().st_size > 1000


def test_a_method_the_model_cannot_take_fails_before_any_sample_runs():
    """transformers' quantized cache refuses models with sliding-window layers (Gemma 3): the
    run stops before fp16's samples, naming the method, instead of after them."""
    from hqekv.eval.runner import check_methods

    from ..helpers import tiny_model

    model = tiny_model("gemma3_text")
    check_methods(model, [parse_method(m) for m in ("fp16", "hqekv:2", "evict:2")])
    with pytest.raises(ValueError, match="method quanto:4 cannot run on this model: .*sliding"):
        check_methods(model, [parse_method(m) for m in ("fp16", "quanto:4")])
    for method in ("calibrated:2", "paper:2", "random:2"):  # they need an artifact, which this model has not
        with pytest.raises(ValueError, match=f"method {method} cannot run on this model: ratios='calibrated': no calib"):
            check_methods(model, [parse_method(method)])
    calls = []

    class Probe:  # a task that records it ran: it must not, when a later method cannot run
        name = "needle"

        def samples(self, *args):
            calls.append("samples")
            return []

    import hqekv.eval.runner as runner

    original = runner.TASKS["needle"]
    runner.TASKS["needle"] = Probe()
    try:
        with pytest.raises(ValueError, match="quanto:4"):
            evaluate(model, None, ["fp16", "quanto:4"], ["needle"], samples=1, lengths=[256], progress=False)
    finally:
        runner.TASKS["needle"] = original
    assert calls == []


@pytest.fixture
def dying_eval(tmp_path, monkeypatch):
    """`hqekv eval` of a tiny model on a needle task whose sample "s1" fails while ``dies``
    holds it, as a crash an hour in would: (argv, out, runs), ``runs`` the samples run."""
    import torch

    import hqekv.eval.runner as runner
    from hqekv.eval.tasks import Sample

    from ..helpers import tiny_llama

    runs, dies = [], {"s1"}

    class Dies:
        name, metric, higher_is_better = "needle", "pass-key exact match", True

        def samples(self, tokenizer, n, lengths, seed):
            return [Sample(f"s{i}", torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(i)), ["x"])
                    for i in range(n)]  # fmt: skip

        def run(self, model, tokenizer, sample, cache=None, prefill_chunk=None, reference=None):
            if sample.id in dies:
                raise RuntimeError("died")
            runs.append(sample.id)
            out = model(sample.input_ids, use_cache=True)
            return {"prediction": "x", "score": float(out.logits[0, -1].argmax()), "prefill_s": 0.1}, out.past_key_values

    monkeypatch.setitem(runner.TASKS, "needle", Dies())
    monkeypatch.setattr("hqekv.packaged_models.load_model", lambda *a, **k: (tiny_llama(), None, "tiny"))
    out = tmp_path / "run"
    argv = ["eval", "--model", "smollm2", "--methods", "fp16", "--tasks", "needle", "--samples", "3", "--lengths",
            "64", "--out", str(out), "--no-progress"]  # fmt: skip
    return argv, out, runs, dies


def test_hqekv_eval_keeps_each_finished_record_on_disk_when_a_run_dies(dying_eval):
    import hqekv.cli as cli

    argv, out, _, _ = dying_eval
    with pytest.raises(RuntimeError, match="died"):
        cli._eval(cli.build_parser().parse_args(argv))
    settings, kept = cli.read_partial(out / cli.PARTIAL_RECORDS)
    assert settings["samples"] == 3 and settings["methods"] == ["fp16"]
    assert [(r["sample"], r["method"]) for r in kept] == [("s0", "fp16")]
    assert kept[0]["cache_bytes"] > 0


def test_hqekv_eval_resume_runs_only_the_samples_a_run_cut_short_did_not_finish(dying_eval, tmp_path):
    import hqekv.cli as cli

    argv, out, runs, dies = dying_eval
    with pytest.raises(RuntimeError, match="died"):
        cli._eval(cli.build_parser().parse_args(argv))
    with (out / cli.PARTIAL_RECORDS).open("a") as partial:
        partial.write('{"prediction": "x", "sco')  # the record a run killed while writing it left
    dies.clear()
    assert cli._eval(cli.build_parser().parse_args([*argv, "--resume"])) == 0
    assert runs == ["s0", "s1", "s2"], "s0 was kept, not run again"
    assert not (out / cli.PARTIAL_RECORDS).exists()
    whole = tmp_path / "whole"
    cli._eval(cli.build_parser().parse_args([*argv[:-3], "--out", str(whole), "--no-progress"]))
    fields = ("task", "method", "index", "sample", "score", "cache_bytes")
    resumed, once = (json.loads((d / "results.json").read_text()) for d in (out, whole))
    assert [[r[f] for f in fields] for r in resumed["records"]] == [[r[f] for f in fields] for r in once["records"]]


def test_hqekv_eval_refuses_to_discard_or_mix_in_the_records_of_a_run_cut_short(dying_eval, capsys):
    import hqekv.cli as cli

    argv, out, _, dies = dying_eval
    with pytest.raises(RuntimeError, match="died"):
        cli._eval(cli.build_parser().parse_args(argv))
    dies.clear()
    partial = out / cli.PARTIAL_RECORDS
    before = partial.read_text()
    assert cli._eval(cli.build_parser().parse_args(argv)) == 2, "without --resume the finished records are not thrown away"
    assert "--resume continues it" in capsys.readouterr().err
    other_seed = [*argv, "--seed", "1", "--resume"]
    assert cli._eval(cli.build_parser().parse_args(other_seed)) == 2, "records of other samples are not mixed in"
    assert "seed: 0 there, 1 here" in capsys.readouterr().err
    assert partial.read_text() == before


def test_hqekv_eval_runs_again_a_run_cut_short_before_its_first_record(dying_eval):
    import hqekv.cli as cli

    argv, out, runs, dies = dying_eval
    dies.add("s0")
    with pytest.raises(RuntimeError, match="died"):
        cli._eval(cli.build_parser().parse_args(argv))
    assert cli.read_partial(out / cli.PARTIAL_RECORDS)[1] == []
    dies.clear()
    assert cli._eval(cli.build_parser().parse_args(argv)) == 0, "nothing finished, nothing to keep"
    assert runs == ["s0", "s1", "s2"]


def test_hqekv_eval_chunked_prefill_patches_every_hqekv_method_with_it_and_records_it(dying_eval, capsys):
    """``--chunked-prefill evict`` reaches ``patch_model`` of each compressed method (and is
    recorded with its records and settings); without ``--prefill-chunk`` it is refused
    before the model loads."""
    import hqekv.cli as cli

    argv, out, _, dies = dying_eval
    dies.clear()
    argv = [*argv[:4], "fp16", "auto:2", *argv[5:]]
    assert cli._eval(cli.build_parser().parse_args([*argv, "--chunked-prefill", "evict"])) == 2
    assert "needs --prefill-chunk" in capsys.readouterr().err
    assert cli._eval(cli.build_parser().parse_args([*argv, "--prefill-chunk", "32", "--chunked-prefill", "evict"])) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["settings"]["chunked_prefill"] == "evict"
    assert "--chunked-prefill evict" in result["settings"]["command"]
    modes = {r["method"]: r["chunked_prefill"] for r in result["records"]}
    assert modes == {"fp16": None, "auto:2": "evict"}

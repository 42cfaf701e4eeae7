"""The lm-evaluation-harness model type ``hqekv``, offline, on a two-document generation task."""

import json

import pytest

from hqekv.texts import passkey_prompt

pytestmark = pytest.mark.slow

TASK = """
task: hqekv_tiny_passkey
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["<|im_end|>"]
  max_gen_toks: 12
  do_sample: false
filter_list:
  - name: contains
    filter:
      - function: regex
        regex_pattern: "(\\\\d{{5}})"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, smollm2):
    _, tok = smollm2
    d = tmp_path_factory.mktemp("lm_eval_task")
    rows = []
    for seed, depth in ((2, 0.75), (4, 0.9)):
        prompt, key = passkey_prompt(tok, 600, depth=depth, seed=seed)
        rows.append({"prompt": prompt, "answer": key})
    (d / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (d / "tiny.yaml").write_text(TASK.format(data=d / "data.jsonl"))
    return d


def _evaluate(model_name, model_args, task_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model_name,
        model_args=model_args,
        tasks=["hqekv_tiny_passkey"],
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        batch_size=1,
        apply_chat_template=False,
    )


def test_every_cache_setting_reaches_patch_model_converted():
    from hqekv.config import CACHE_SETTINGS
    from hqekv.lm_eval_plugin import PATCH_ARGS, patch_arguments

    assert set(CACHE_SETTINGS) <= set(PATCH_ARGS)
    kwargs = {"bavg": "2", "chunk_size": "32", "window": "20", "metadata_dtype": "bfloat16", "rotation": "none",
              "fp_dtype": "model", "eviction": "joint", "batch_size": 1}  # fmt: skip
    patch = patch_arguments(kwargs)
    assert kwargs == {"batch_size": 1}, "lm-eval's own arguments stay"
    assert patch == {"bavg": 2.0, "chunk_size": 32, "window": 20, "metadata_dtype": "bfloat16", "rotation": None,
                     "fp_dtype": "model", "eviction": "joint"}  # fmt: skip


def _responses(result):
    return [s["resps"][0][0] for s in result["samples"]["hqekv_tiny_passkey"]]


def test_hqekv_model_type_patches_and_generates(smollm2, task_dir):
    import hqekv.lm_eval_plugin  # noqa: F401  (registers the "hqekv" model type)

    model, tok = smollm2
    plain = _evaluate("hf", {"pretrained": model, "tokenizer": tok}, task_dir)
    try:
        same = _evaluate("hqekv", {"pretrained": model, "tokenizer": tok, "bavg": 16, "fp_dtype": "model",
                                   "rotation": "none"}, task_dir)  # fmt: skip
        assert hqekv.patch_config(model).ratios == hqekv.FP16_RATIOS and hqekv.patch_config(model).rotation is None
        assert _responses(same) == _responses(plain), "all-FP16 hqekv must generate what the plain model does"
        hqekv.unpatch_model(model)

        compressed = _evaluate("hqekv", {"pretrained": model, "tokenizer": tok, "bavg": "2", "window": "20"}, task_dir)
        config = hqekv.patch_config(model)
        assert config.bavg == 2.0 and config.ratios_source.startswith("shipped:") and config.rotation is None
        report = hqekv.memory_report(model)
        quantized = sum(report.chunks[f"k.{t}"] for t in ("int4", "int2", "int1"))
        assert quantized > 0 and report.bavg < 4, "the generations ran through the compressed cache"
        for result in (plain, same, compressed):
            assert 0.0 <= result["results"]["hqekv_tiny_passkey"]["exact_match,contains"] <= 1.0
        assert len(_responses(compressed)) == 2 and all(isinstance(r, str) for r in _responses(compressed))
    finally:
        if hqekv.is_patched(model):
            hqekv.unpatch_model(model)

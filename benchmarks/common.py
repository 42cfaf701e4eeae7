"""Shared by the benchmark scripts: SmolLM2 loading, prompts, peak memory, result files."""

import json
import os
import platform
import re
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def load_smollm2():
    from hqekv.packaged_models import SMOLLM2, load_model

    model, tokenizer, _ = load_model(SMOLLM2)
    return model, tokenizer


def essay_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    from hqekv.texts import essays

    ids = tokenizer(essays()[: 8 * n_tokens], add_special_tokens=False, return_tensors="pt").input_ids
    if ids.shape[1] < n_tokens:
        raise ValueError(f"essays give only {ids.shape[1]} tokens, {n_tokens} asked")
    return ids[:, :n_tokens]


def dense_cache_bytes(cache) -> int:
    from hqekv.eval import cache_memory

    return cache_memory(cache)["cache_bytes"]


CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""CPU flags that change which kernels torch runs, and so the figures: with ``amx_bf16`` a bf16
SDPA on the CPU holds a packed copy of its keys and values (``benchmarks/sdpa_memory.py``)."""


def cpu_features() -> list[str]:
    """Those of :data:`CPU_FEATURES` that this CPU has (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return [f for f in CPU_FEATURES if f in flags]


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


class PeakMeter:
    """Peak memory of what runs between :meth:`start` and :meth:`stop`, beyond what was held at
    the start; ``what``: that code, for :attr:`method`."""

    def __init__(self, device: str, what: str = "generate"):
        self.device, self.what = device, what

    def start(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak RSS (VmHWM) starts again from the current RSS
            self.base = _kib("VmRSS")

    def stop(self) -> int:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _kib("VmHWM") - self.base

    @property
    def method(self) -> str:
        if self.device == "cuda":
            return f"torch.cuda.max_memory_allocated() during {self.what} minus memory_allocated() before it"
        return f"peak RSS (VmHWM, reset by /proc/self/clear_refs) during {self.what} minus the RSS before it"


RELEASE_FREED = "MALLOC_MMAP_THRESHOLD_=65536"
"""glibc: freed blocks of 64 KiB or more go back to the system at once, so that a process's
peak resident set is that of the memory in use."""


def release_freed_env() -> dict[str, str]:
    """This process's environment with :data:`RELEASE_FREED`, for a case's fresh process."""
    name, value = RELEASE_FREED.split("=")
    return {**os.environ, name: value}


ROW = "ROW "
"""How a case run in a fresh process hands its figures back: one line of stdout, this then JSON."""


def patch_arguments(setting: str) -> dict:
    """``patch_model`` arguments of an hqekv setting ``B[:auto][:RULE]``: the budget, the
    allocator (``ratios="auto"``) and a ``chunked_prefill`` rule other than the default
    "wait" (``evict``, ``wait-4bit``)."""
    from hqekv.config import CHUNKED_PREFILL

    bavg, *options = setting.split(":")
    rules = [o for o in options if o in CHUNKED_PREFILL]
    unknown = set(options) - {"auto", *CHUNKED_PREFILL}
    if unknown or len(rules) > 1:
        raise ValueError(f"hqekv setting {setting!r}: unknown or repeated options (B[:auto][:RULE], RULE one of "
                         f"{', '.join(CHUNKED_PREFILL)})")
    return {"bavg": float(bavg), **({"ratios": "auto"} if "auto" in options else {}),
            **({"chunked_prefill": rules[0]} if rules else {})}  # fmt: skip


def print_row(row: dict) -> None:
    print(ROW + json.dumps(row), flush=True)


def read_row(stdout: str) -> dict | None:
    """The figures a case printed with :func:`print_row` (its last such line), or None."""
    rows = [line for line in stdout.splitlines() if line.startswith(ROW)]
    return json.loads(rows[-1][len(ROW) :]) if rows else None


def save(name: str, payload: dict, path: Path | str | None = None) -> Path:
    """Write ``payload`` with the machine it ran on to ``results/NAME.json``, or to ``path``."""
    path = RESULTS / f"{name}.json" if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cpu_features": cpu_features()},
        **payload,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"saved {path}")
    return path

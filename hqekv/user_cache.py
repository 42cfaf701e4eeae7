"""Where hqekv keeps files for a user: ``$HQEKV_CACHE``, else ``~/.cache/hqekv``.

One directory, one variable, for everything hqekv writes outside a project: the CPU
kernel library (built once per source, compiler and CPU; :mod:`hqekv.kernels.mixed_attention_cpu`), the
packaged models joined from their parts and converted from GGUF (:mod:`hqekv.packaged_models`), and the artifacts
``hqekv calibrate`` writes by default, which ``patch_model`` finds by itself
(:data:`ARTIFACTS`, :mod:`hqekv.artifacts`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

VARIABLE = "HQEKV_CACHE"
ARTIFACTS = "artifacts"
"""The subdirectory of calibrated artifacts."""


def cache_dir() -> Path:
    """``$HQEKV_CACHE`` (``~`` expanded), else ``~/.cache/hqekv``; not created here."""
    value = os.environ.get(VARIABLE)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "hqekv"


def artifacts_dir() -> Path:
    """Where ``hqekv calibrate`` writes artifacts by default and ``patch_model`` looks for them."""
    return cache_dir() / ARTIFACTS


@contextlib.contextmanager
def atomic_write(target: Path) -> Iterator[IO[bytes]]:
    """A binary file to write ``target`` through: a temporary file next to it that replaces
    ``target`` in one step when the block ends, readable by all (mode 0644, as a file a user
    writes; not the owner-only mode of a temporary file), and is removed if the block raises.
    A reader never finds the file cut short, nor a half-written one in place of a good one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    out = tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", delete=False)
    try:
        with out:
            yield out
        os.chmod(out.name, 0o644)
        os.replace(out.name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(out.name)
        raise

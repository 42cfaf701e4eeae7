"""Evaluation: tasks × KV-cache methods at equal memory (``hqekv eval``).

``evaluate`` returns per-sample records, ``write_results`` turns them into results.json,
results.md and one plot per task. Methods are in :mod:`hqekv.eval.methods`, tasks in
:mod:`hqekv.eval.tasks`.
"""

from .methods import Method, parse_method
from .runner import DEFAULT_METHODS, DEFAULT_TASKS, cache_memory, evaluate, summarize, write_results
from .tasks import TASKS

__all__ = [
    "DEFAULT_METHODS",
    "DEFAULT_TASKS",
    "Method",
    "TASKS",
    "cache_memory",
    "evaluate",
    "parse_method",
    "summarize",
    "write_results",
]

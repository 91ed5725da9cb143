"""Evaluation: unbiased Pass@k, Avg@k, per-benchmark aggregation and the generate-grade-aggregate runner.

The entries load on first use: ``megatron_maspo.eval.config`` (read by the CLI to check a ``--set``)
costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_maspo.eval.metrics import avg_at_k, pass_at_k, summarize
    from megatron_maspo.eval.runner import EvalReport, evaluate

_HOME = {"avg_at_k": "metrics", "pass_at_k": "metrics", "summarize": "metrics", "EvalReport": "runner",
         "evaluate": "runner"}
__all__ = ["EvalReport", "avg_at_k", "evaluate", "pass_at_k", "summarize"]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Evaluation: unbiased Pass@k, Avg@k, per-benchmark aggregation and the generate-grade-aggregate runner."""

from __future__ import annotations

from megatron_maspo.eval.metrics import avg_at_k, pass_at_k, summarize
from megatron_maspo.eval.runner import EvalReport, evaluate

__all__ = ["EvalReport", "avg_at_k", "evaluate", "pass_at_k", "summarize"]

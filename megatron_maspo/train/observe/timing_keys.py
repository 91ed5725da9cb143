"""Which logged metrics are wall-clock measurements (and so differ between two runs of the same job).

Comparisons of runs (the resume and placement tests, ``scripts/compare_metrics.py``) drop exactly these
and compare everything else for equality. One rule, here, so that a new timing metric is declared once
(name it ``..._s`` under ``sync/`` or ``..._per_s`` anywhere) and no comparison mistakes it for a result.
"""

from __future__ import annotations

TIMING_PREFIXES = ("time/", "memory/", "rollout/gen_tokens_per_s")
"""Wall times of the step's phases, memory figures (allocator state differs between processes) and the
per-engine generation rates (``rollout/gen_tokens_per_s_*``)."""

TIMING_KEYS = frozenset({"rollout/engine_busy_s", "sync/engine_pause_share"})
"""Timings outside the naming rule below."""


def is_timing(key: str) -> bool:
    """Whether metric ``key`` measures wall time, a rate or memory rather than a result of the run.

    ``time/*``, ``memory/*``, any ``*_per_s`` rate, every ``sync/*_s`` duration (``transfer_s``,
    ``engine_pause_s``, ``verify_s``, ``verify_full_s``) and :data:`TIMING_KEYS`.
    """
    return (key.startswith(TIMING_PREFIXES) or key.endswith("_per_s") or key in TIMING_KEYS
            or (key.startswith("sync/") and key.endswith("_s")))

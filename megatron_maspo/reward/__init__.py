"""Verifiable rewards: answer extraction, math-verify grading in a process pool, +1/-1 scoring.

Importing this package is cheap; math-verify is imported only inside the pool workers
(``reward/math_verify.py`` is its only importer).
"""

from __future__ import annotations

from megatron_maspo.reward.base import GradeStatus, RewardFn, RewardOutput
from megatron_maspo.reward.config import RewardConfig

__all__ = ["GradeStatus", "RewardConfig", "RewardFn", "RewardOutput"]

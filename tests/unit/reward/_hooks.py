"""Module-level grader variants for pool tests (workers import them by name)."""

from __future__ import annotations

import os
import time

from megatron_maspo.reward.base import GradeStatus


def crash_or_grade(
    response: str, gold: str, policy: str, max_chars: int, timeout_s: float
) -> GradeStatus:
    """Die like a segfault on ``CRASH``, hang in a non-interruptible way on ``HANG``, else grade."""
    if response == "CRASH":
        os._exit(7)
    if response == "HANG":
        time.sleep(3600)
    if response == "ALLOC":
        bytearray(16 * 2**30)  # 16 GiB: must hit the worker's RLIMIT_AS, not the machine
    if response == "RAISE":
        raise RuntimeError("grader bug")
    from megatron_maspo.reward.math_verify import grade_math

    return grade_math(response, gold, policy, max_chars, timeout_s)

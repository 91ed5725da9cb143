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


_VALUES = {"nan": float("nan"), "no": "no", "none": None, "one": 1, "true": True, "false": False}


def returns_what_it_is_told(response: str, answer: str) -> object:
    """A ``reward.grader`` returning the value named by the response (``"nan"``, ``"no"``, ...)."""
    if response == "npbool":
        import numpy as np

        return np.bool_(True)
    return _VALUES[response]


def sleeps(response: str, answer: str) -> bool:
    """A ``reward.grader`` that never answers in time."""
    time.sleep(3600)
    return True


def dies_in_warmup(response: str, answer: str) -> bool:
    """A ``reward.grader`` that kills its worker on the pool's warm-up item."""
    if answer == "0.5":
        os._exit(3)
    return True


def hangs_in_warmup(response: str, answer: str) -> bool:
    """A ``reward.grader`` that hangs on the pool's warm-up item, deaf to the warm-up's alarm (like C code)."""
    if answer == "0.5":
        import signal

        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        time.sleep(3600)
    return True

"""The reward protocol the RL loop and the evaluator call, and the plain data it returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class GradeStatus(enum.StrEnum):
    """Outcome of grading one response; everything but ``CORRECT`` scores the incorrect reward."""

    CORRECT = "correct"
    WRONG = "wrong"
    """An answer was extracted and parsed but is not equivalent to the ground truth."""
    NO_ANSWER = "no_answer"
    """No final answer found under the fallback policy, or it did not parse."""
    TIMEOUT = "timeout"
    """The worker overran ``timeout_s`` and was killed."""
    CRASH = "crash"
    """The worker died (segfault, ``os._exit``, OOM kill) while grading this item."""
    ERROR = "error"
    """The grader raised; the exception's type is logged once per batch."""
    INVALID = "invalid"
    """A user grader returned something other than a bool (``None``, NaN, a string)."""


@dataclass(kw_only=True)
class RewardOutput:
    """Rewards for a batch of responses."""

    rewards: list[float]
    """``[B]`` scalar reward per response (``correct_reward`` or ``incorrect_reward``)."""
    statuses: list[GradeStatus]
    """``[B]`` grading outcome per response."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Counts keyed ``reward/<status>_count`` plus ``reward/mean`` and ``reward/seconds``."""

    @property
    def correct(self) -> list[bool]:
        """``[B]`` whether each response verified."""
        return [s is GradeStatus.CORRECT for s in self.statuses]


@runtime_checkable
class RewardFn(Protocol):
    """Scores responses against ground-truth answers (one call per batch, any batch size)."""

    def __call__(self, responses: list[str], ground_truths: list[str]) -> RewardOutput:
        """Grade ``responses[i]`` against ``ground_truths[i]``; both ``[B]`` decoded strings."""
        ...

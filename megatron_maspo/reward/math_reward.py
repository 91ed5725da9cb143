"""The MASPO math reward: +1 if the final answer is equivalent to the ground truth, else -1 (C.2).

Usage::

    with MathReward(RewardConfig(num_workers=4)) as reward_fn:
        out = reward_fn(responses_B, ground_truths_B)   # out.rewards_B, out.statuses, out.metrics
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable

from megatron_maspo.errors import GraderError
from megatron_maspo.reward.base import GradeStatus, RewardOutput
from megatron_maspo.reward.config import RewardConfig
from megatron_maspo.reward.pool import GraderPool

logger = logging.getLogger(__name__)

_GRADER_MODULE = "megatron_maspo.reward.math_verify"
_BAD = (GradeStatus.INVALID, GradeStatus.TIMEOUT, GradeStatus.CRASH, GradeStatus.ERROR)
# What to do about each kind of failure: a grader returning a float is not helped by a longer timeout.
_REMEDY = {
    GradeStatus.INVALID: "return a bool from the grader (True when the answer is correct)",
    GradeStatus.ERROR: "fix the exception the grader raises",
    GradeStatus.CRASH: "find why the grader's process dies (native code, or memory: reward.max_worker_rss_mb)",
    GradeStatus.TIMEOUT: "raise reward.timeout_s / reward.grading_budget_s for a slow grader",
}


def judge(value: object) -> GradeStatus | tuple[GradeStatus, str]:
    """A user grader's return value as a status: only a bool (or numpy bool) is an answer.

    Truthiness would score ``"no"``, NaN and ``[False]`` correct; anything but a bool is ``INVALID``
    with its type name as the note.
    """
    kind = type(value)
    if kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")):
        return GradeStatus.CORRECT if value else GradeStatus.WRONG
    return GradeStatus.INVALID, f"returned {kind.__name__}"


def _grade(response: str, gold: str, policy: str, max_chars: int, timeout_s: float) -> GradeStatus:
    # Module-level trampoline: the pool pickles it by name, and the math_verify import happens only
    # in the workers (the fork server preloads it), never in the trainer process.
    from megatron_maspo.reward.math_verify import grade_math

    return grade_math(response, gold, policy, max_chars, timeout_s)


class UserGrade:
    """Picklable grader for ``RewardConfig.grader``: calls the user's ``fn(response, answer) -> bool`` in
    the pool workers (same signature as ``_grade``; the extraction settings are the user's business)."""

    def __init__(self, target: str) -> None:
        from megatron_maspo.plugins import resolve

        resolve(target, "reward.grader")  # fail in the trainer, with the field named, not in a worker
        self.target = target

    def __call__(self, response: str, gold: str, policy: str, max_chars: int,
                 timeout_s: float) -> GradeStatus | tuple[GradeStatus, str]:
        from megatron_maspo.plugins import resolve

        return judge(resolve(self.target, "reward.grader")(response, gold))


class MathReward:
    """Math-Verify reward over a persistent :class:`GraderPool` (implements ``RewardFn``).

    Args:
        config: rewards, timeouts, worker count, caps and extraction policy.
        grade_fn: module-level grader with ``_grade``'s signature; tests inject crashing variants.
    """

    def __init__(self, config: RewardConfig, *, grade_fn=_grade) -> None:
        self.config = config
        self.totals: Counter[str] = Counter()
        """Lifetime ``GradeStatus`` counts across calls."""
        preload = _GRADER_MODULE
        self.name = "math-verify" if grade_fn is _grade else getattr(grade_fn, "__name__", "grader")
        """The grader's name in messages: ``math-verify`` or the ``module:function`` target."""
        if config.grader and grade_fn is _grade:
            grade_fn, preload = UserGrade(config.grader), config.grader.split(":")[0]
            self.name = config.grader
        self._pool = GraderPool(
            grade_fn,
            num_workers=config.num_workers,
            timeout_s=config.timeout_s,
            start_method=config.start_method,
            warmup=(r"\boxed{\frac{1}{2}}", "0.5", config.fallback, config.max_chars, 5.0),
            preload=(preload,),
            max_worker_rss_mb=config.max_worker_rss_mb,
            max_tasks_per_worker=config.max_tasks_per_worker,
            address_space_mb=config.max_worker_address_space_mb,
            name=self.name,
        )

    def __call__(self, responses: list[str], ground_truths: list[str], *,
                 progress: Callable[[int], None] | None = None) -> RewardOutput:
        """Grade ``responses[i]`` against ``ground_truths[i]`` (both ``[B]``); see ``RewardOutput``.

        ``progress(k)``, when given, is called as ``k`` more responses are graded.

        Raises:
            ValueError: the two lists differ in length.
            TypeError: an element is not a ``str``.
            GraderError: more than ``max_bad_fraction`` of the items were invalid, timed out or failed.
        """
        if len(responses) != len(ground_truths):
            raise ValueError(
                f"responses ({len(responses)}) and ground_truths ({len(ground_truths)}) differ in length"
            )
        for name, seq in (("responses", responses), ("ground_truths", ground_truths)):
            bad = next((i for i, x in enumerate(seq) if not isinstance(x, str)), None)
            if bad is not None:
                raise TypeError(f"{name}[{bad}] must be str, got {type(seq[bad]).__name__}")
        cfg = self.config
        t0 = time.perf_counter()
        statuses = self._pool.map(
            [
                (r, g, cfg.fallback, cfg.max_chars, cfg.timeout_s)
                for r, g in zip(responses, ground_truths)
            ],
            progress=progress,
            deadline_s=self.deadline_s(len(responses)),
        )
        rewards = [
            cfg.correct_reward if s is GradeStatus.CORRECT else cfg.incorrect_reward
            for s in statuses
        ]
        counts = Counter(statuses)
        self.totals.update(s.value for s in statuses)
        metrics = {f"reward/{s.value}_count": float(counts.get(s, 0)) for s in GradeStatus}
        metrics["reward/mean"] = sum(rewards) / len(rewards) if rewards else 0.0
        metrics["reward/seconds"] = time.perf_counter() - t0
        self._check(counts, len(statuses))
        return RewardOutput(rewards=rewards, statuses=statuses, metrics=metrics)

    def deadline_s(self, n: int) -> float:
        """Wall-clock budget of one batch of ``n`` items (see ``RewardConfig.grading_budget_s``)."""
        cfg = self.config
        return cfg.timeout_s + cfg.grading_budget_s * math.ceil(n / cfg.num_workers)

    def _check(self, counts: Counter, n: int) -> None:
        """Log one line for the batch's failed items; raise when too many failed."""
        failed = sum(counts[s] for s in _BAD)
        if not failed:
            return
        why = ", ".join(f"{k} x{v}" for k, v in self._pool.last_notes.most_common(4))
        line = f"grader {self.name}: {failed}/{n} items scored incorrect because they failed ({why})"
        if failed > self.config.max_bad_fraction * n:
            todo = "; ".join(_REMEDY[s] for s in sorted(_BAD, key=lambda s: -counts[s]) if counts[s])
            raise GraderError(f"{line}; over reward.max_bad_fraction={self.config.max_bad_fraction:g}, "
                              f"stopping ({todo})")
        logger.warning("%s", line)

    def worker_pids(self) -> list[int]:
        """PIDs of the grading workers (for memory checks)."""
        return self._pool.worker_pids()

    @property
    def pool_events(self) -> Counter[str]:
        """Lifetime pool events: ``started``, ``timeout``, ``crash``, ``recycled``."""
        return self._pool.events

    def close(self) -> None:
        """Stop the workers."""
        self._pool.close()

    def __enter__(self) -> MathReward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

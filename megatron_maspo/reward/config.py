"""Configuration of the math reward (MASPO C.2: +1 correct, -1 otherwise)."""

from __future__ import annotations

from dataclasses import dataclass

FALLBACK_POLICIES = ("boxed", "boxed_or_answer_line", "any")
START_METHODS = ("forkserver", "spawn", "fork")


@dataclass(kw_only=True)
class RewardConfig:
    """How responses are graded against ground-truth answers."""

    correct_reward: float = 1.0
    """Reward of a response whose final answer verifies; +1 in MASPO (C.2)."""
    incorrect_reward: float = -1.0
    """Reward of a wrong, missing, unparseable, timed-out or crashed answer; -1 in MASPO (C.2)."""
    timeout_s: float = 5.0
    """Hard wall-clock limit per item in seconds, measured from dispatch to a warm worker. A worker that
    overruns is killed and replaced, and the item scores ``incorrect_reward`` (status ``timeout``)."""
    num_workers: int = 2
    """Grading processes. Each holds math-verify and sympy (~80 MB RSS measured)."""
    max_chars: int = 4096
    """Cap on the text handed to the parser: the extracted answer span, or the response tail when the
    fallback policy lets math-verify search the whole text. 100k-character outputs cost O(max_chars)."""
    fallback: str = "boxed_or_answer_line"
    """Final-answer extraction policy: ``"boxed"`` (last ``\\boxed{}``/``\\fbox{}`` only; none ⇒ wrong),
    ``"boxed_or_answer_line"`` (then the last ``Answer:`` line, DAPO-Math's format), ``"any"`` (then let
    math-verify search the last ``max_chars`` characters, e.g. a bare final number)."""
    max_worker_rss_mb: int = 1024
    """A worker whose resident memory exceeds this after an item is recycled (memory stays bounded even
    if sympy caches grow). The item it just graded keeps its result."""
    max_worker_address_space_mb: int = 4096
    """Hard ``RLIMIT_AS`` of each worker (virtual memory, MiB): an item that tries to allocate more gets a
    ``MemoryError`` (status ``error``) instead of swapping the node. 0 = unlimited."""
    max_tasks_per_worker: int = 2000
    """Recycle a worker after this many items (bounds slow cache growth); 0 = never."""
    grader: str = ""
    """A user grader instead of math-verify: ``"module:function"`` with ``function(response: str, answer:
    str) -> bool`` (True = correct). It runs in the same crash-proof pool (timeouts, crashes and exceptions
    score ``incorrect_reward``); see ``examples/custom_reward.py``. Only a ``bool`` (or numpy bool) counts:
    any other value (``None``, NaN, ``1``, ``"no"``) is status ``invalid``, scored ``incorrect_reward`` and
    reported once per batch with its type. The module is imported by name from ``PYTHONPATH`` or an
    installed package, never from the working directory implicitly (``docs/security.md``). Empty =
    math-verify."""
    grading_budget_s: float = 0.25
    """Average seconds per item per worker a whole batch may take: a batch of ``B`` items on ``W``
    workers must finish within ``timeout_s + grading_budget_s * ceil(B / W)`` (37 s for 256 items on 2
    workers at the defaults; math-verify needs ~0.01 s per item). Items left then score ``timeout``, so a
    grader that sleeps cannot stall a step for ``B * timeout_s / W``."""
    max_bad_fraction: float = 0.5
    """Stop the run with one line naming the grader when more than this fraction of one batch is
    ``invalid``, ``timeout``, ``crash`` or ``error`` (a broken grader, not hard answers). 1.0 = never."""
    start_method: str = "forkserver"
    """multiprocessing start method for the workers. ``forkserver`` forks replacements from a clean
    server that pre-imports math-verify (fast, and safe when the trainer process has threads)."""

    def __post_init__(self) -> None:
        if not self.correct_reward > self.incorrect_reward:
            raise ValueError(
                f"RewardConfig.correct_reward ({self.correct_reward}) must exceed "
                f"incorrect_reward ({self.incorrect_reward})"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"RewardConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.num_workers < 1:
            raise ValueError(f"RewardConfig.num_workers must be >= 1, got {self.num_workers}")
        if self.max_chars < 16:
            raise ValueError(f"RewardConfig.max_chars must be >= 16, got {self.max_chars}")
        if self.fallback not in FALLBACK_POLICIES:
            raise ValueError(
                f"RewardConfig.fallback must be one of {FALLBACK_POLICIES}, got {self.fallback!r}"
            )
        if self.max_worker_rss_mb < 64:
            raise ValueError(
                f"RewardConfig.max_worker_rss_mb must be >= 64, got {self.max_worker_rss_mb}"
            )
        if self.max_worker_address_space_mb and self.max_worker_address_space_mb < 1024:
            raise ValueError(
                "RewardConfig.max_worker_address_space_mb must be 0 or >= 1024, got "
                f"{self.max_worker_address_space_mb}"
            )
        if self.max_tasks_per_worker < 0:
            raise ValueError(
                f"RewardConfig.max_tasks_per_worker must be >= 0, got {self.max_tasks_per_worker}"
            )
        if not self.grading_budget_s > 0:
            raise ValueError(f"RewardConfig.grading_budget_s must be > 0, got {self.grading_budget_s}")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ValueError(
                f"RewardConfig.max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}")
        if self.grader:
            from megatron_maspo.plugins import check_target

            check_target(self.grader, "reward.grader")
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"RewardConfig.start_method must be one of {START_METHODS}, got {self.start_method!r}"
            )

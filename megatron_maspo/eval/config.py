"""Evaluation during training (``eval.*``): held-out benchmarks every N rollout steps."""

from __future__ import annotations

from dataclasses import dataclass, field

GRADERS = ("math_verify", "prime_math")


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out evaluation inside ``maspo train`` (the paper's accuracy-over-steps curves).

    Row ``s`` of metrics.jsonl then holds ``eval/<benchmark>/avg@k`` and ``eval/<benchmark>/pass@j``
    of the policy that generated step ``s`` (θ_s), plus a last row after the final step. Runs on the
    engine's rank, with the run's prompt template, between two training steps.
    """

    every: int = 0
    """Evaluate every N rollout steps (and after the last); 0 = off."""
    data: list[str] = field(default_factory=list)
    """Held-out benchmark files (jsonl/json/parquet; benchmark field names are detected)."""
    benchmarks: str | None = None
    """A folder holding AIME24/AIME25/AMC23/MATH500/Minerva/OlympiadBench files, found by name."""
    k: int = 32
    """Samples per problem: Avg@k and Pass@1..k (the paper: 32)."""
    temperature: float | None = None
    """None = the rollout temperature; 0 = greedy."""
    max_new_tokens: int | None = None
    """None = the rollout budget."""
    num_problems: int = 64
    """Without ``data`` / ``benchmarks``: a fresh draw of the synthetic task with another seed."""
    dropped_as_wrong: bool = True
    """Prompts over ``data.max_prompt_tokens`` count as 0 of k correct (always reported)."""
    grader: str = "math_verify"
    """Grader of evaluation (``maspo eval`` without ``--grader``, and ``eval.every`` in training):
    'math_verify' (the training reward) or 'prime_math' (the evaluation grader rules of the MASPO
    paper, §5.1, ``reward/prime_grader.py``). The paper recipes set 'prime_math'."""

    def __post_init__(self) -> None:
        if self.grader not in GRADERS:
            raise ValueError(f"eval.grader={self.grader!r}; accepted: {list(GRADERS)}")
        if self.every < 0:
            raise ValueError(f"eval.every must be >= 0, got {self.every}")
        if self.k < 1:
            raise ValueError(f"eval.k must be >= 1, got {self.k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"eval.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.num_problems < 1:
            raise ValueError(f"eval.num_problems must be >= 1, got {self.num_problems}")

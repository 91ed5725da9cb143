"""From prompts to a training batch: group rewards, advantages, dynamic sampling, overlong handling.

Pure functions over plain Python data and small tensors; the loop in ``loop.py`` calls them in order.
Shape suffixes: ``_P`` prompts, ``_G`` group members, ``_T`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_maspo.rollout.types import Completion


@dataclass
class PromptGroup:
    """One prompt and its G completions with their rewards."""

    prompt_index: int
    """Position of the prompt in the dataset (for logging and resume)."""
    prompt_ids: list[int]
    answer: str
    completions_G: list[Completion]
    rewards_G: list[float]
    """Final rewards (grade, plus any overlong shaping)."""
    correct_G: list[bool]
    """Whether the grader judged each answer correct."""

    @property
    def degenerate(self) -> bool:
        """All rewards equal: zero group advantage, no policy-gradient signal (loss-formulas.md §1.1)."""
        return max(self.rewards_G) == min(self.rewards_G)


def overlong_penalty(length: int, max_len: int, buffer: int) -> float:
    """DAPO soft overlong punishment R_len (loss-formulas.md §5): 0, a linear ramp to -1 in the buffer, -1 past it."""
    if buffer <= 0 or length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return ((max_len - buffer) - length) / buffer
    return -1.0


def select_groups(groups: list[PromptGroup], want: int, dynamic_sampling: bool) -> tuple[list[PromptGroup], int]:
    """Keep up to ``want`` groups; with dynamic sampling drop degenerate ones first (DAPO).

    Returns:
        (kept groups, number of degenerate groups dropped).
    """
    if not dynamic_sampling:
        return groups[:want], 0
    kept = [g for g in groups if not g.degenerate]
    return kept[:want], len(groups) - len(kept)


def group_metrics(groups: list[PromptGroup], *, max_new_tokens: int) -> dict[str, float]:
    """Reward, accuracy, length and degeneracy statistics of a rollout batch."""
    rewards = [r for g in groups for r in g.rewards_G]
    lengths = [len(c.token_ids) for g in groups for c in g.completions_G]
    truncated = [c.finish_reason == "length" for g in groups for c in g.completions_G]
    correct = [c for g in groups for c in g.correct_G]
    n = max(len(rewards), 1)
    return {
        "reward/mean": sum(rewards) / n,
        "reward/accuracy": sum(correct) / n,
        "reward/pass_at_g": sum(any(g.correct_G) for g in groups) / max(len(groups), 1),
        "response_length/mean": sum(lengths) / n,
        "response_length/max": float(max(lengths, default=0)),
        "response_length/clip_frac": sum(truncated) / n,
        "rollout/degenerate_group_frac": sum(g.degenerate for g in groups) / max(len(groups), 1),
        "rollout/max_new_tokens": float(max_new_tokens),
    }


def rewards_tensor(groups: list[PromptGroup]) -> torch.Tensor:
    """``[P, G]`` float64 rewards."""
    return torch.tensor([g.rewards_G for g in groups], dtype=torch.float64)

"""From prompts to a training batch: group rewards, advantages, dynamic sampling, overlong handling.

Pure functions over plain Python data and small tensors; the loop in ``loop.py`` calls them in order.
Shape suffixes: ``_P`` prompts, ``_G`` group members, ``_T`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_maspo.loss.advantages import compute_advantages
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.loss.group_stats import prompt_group_stats
from megatron_maspo.rollout.types import Completion
from megatron_maspo.train.actor.samples import Sample


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


@dataclass
class RolloutBatch:
    """The prompt groups of one training step and where they came from."""

    step: int
    """0-based step that trains on this batch."""
    version: int
    """Trainer weight version (syncs done) that generated it."""
    kept: list[PromptGroup]
    """Groups trained on (after dynamic sampling and rounding to whole mini-batches)."""
    seen: list[PromptGroup]
    """Every group generated for the step (reward metrics are over these)."""
    dropped: int = 0
    """Degenerate groups dropped by dynamic sampling."""


def samples_from_groups(groups: list[PromptGroup], loss: LossConfig, *, overlong_filter: bool,
                        version_offset: int) -> list[Sample]:
    """One ``Sample`` per kept response, with its group advantage ``adv[P, G]`` (same on every rank).

    Args:
        loss: the loss section (advantage estimator and the per-prompt statistics it needs).
        overlong_filter: DAPO overlong filtering: truncated responses are not trained on.
        version_offset: added to each completion's engine-side policy version (steps before a resume).
    """
    adv = compute_advantages(loss, rewards_tensor(groups))
    # per-prompt statistics over all G responses, before any filtering or packing
    pstats = prompt_group_stats(loss, adv)
    samples = []
    for p, g in enumerate(groups):
        for j, c in enumerate(g.completions_G):
            if overlong_filter and c.finish_reason == "length":
                continue
            samples.append(Sample(prompt_ids=g.prompt_ids, response_ids=list(c.token_ids),
                                  advantage=float(adv[p, j]), prompt_index=p,
                                  rollout_logprobs=torch.tensor(c.logprobs, dtype=torch.float32),
                                  policy_version=c.policy_version + version_offset,
                                  reward=g.rewards_G[j], finish_reason=c.finish_reason,
                                  group_stats=dict(pstats[p]), routed_experts=c.routed_experts))
    return samples

"""Turn engine completions into graded prompt groups (decode, grade in the reward pool)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from megatron_maspo.reward.base import GradeStatus
from megatron_maspo.rollout.types import Completion
from megatron_maspo.train.rollouts.groups import PromptGroup


def grade_groups(reward_fn: Any, tokenizer: Any, idx: list[int], prompts: list[list[int]],
                 answers: list[str], comps_P_G: list[list[Completion]], *,
                 progress: Callable[[int], None] | None = None) -> list[PromptGroup]:
    """Decode every completion, grade all of them in one pool call, regroup per prompt.

    Args:
        reward_fn: a ``RewardFn`` (``MathReward``): ``(responses, ground_truths) -> RewardOutput``.
        tokenizer: decodes token ids (special tokens skipped).
        idx: dataset index of each prompt ``[P]``.
        prompts, answers: ``[P]`` prompt ids and ground-truth answers.
        comps_P_G: ``[P][G]`` completions from the engine.
        progress: ``progress(k)`` as ``k`` more responses are graded (``P·G`` in all).
    """
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for cs in comps_P_G for c in cs]
    golds = [answers[p] for p, cs in enumerate(comps_P_G) for _ in cs]
    # Only rewards that take the hook get it (a user's RewardFn needs just (responses, ground_truths)).
    takes_hook = progress is not None and _takes_progress(reward_fn)
    out = reward_fn(texts, golds, progress=progress) if takes_hook else reward_fn(texts, golds)
    groups, k = [], 0
    for p, cs in enumerate(comps_P_G):
        n = len(cs)
        groups.append(PromptGroup(prompt_index=idx[p], prompt_ids=prompts[p], answer=answers[p],
                                  completions_G=cs, rewards_G=list(out.rewards[k:k + n]),
                                  correct_G=[s is GradeStatus.CORRECT for s in out.statuses[k:k + n]]))
        k += n
    return groups


def _takes_progress(fn: Any) -> bool:
    try:
        return "progress" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # callables without an introspectable signature
        return False

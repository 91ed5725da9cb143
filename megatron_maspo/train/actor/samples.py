"""The unit of training data the RL loop hands to the actor: one (prompt, response) pair."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True)
class Sample:
    """One sampled response and everything the loss needs about it.

    The trainer fills the rollout fields; the actor fills ``old_logprobs`` / ``ref_logprobs``
    (per response token, in the packing the training forward uses, so that ``ρ = 1`` exactly on the
    first mini-batch).
    """

    prompt_ids: list[int]
    """Prompt token ids (chat template applied); must be non-empty."""
    response_ids: list[int]
    """Sampled response token ids, EOS included when the response finished."""
    advantage: float
    """Sequence-level advantage Â_i, broadcast to every response token."""
    prompt_index: int
    """Index of the prompt in the rollout step (groups of G responses share it)."""
    rollout_logprobs: torch.Tensor | list[float] | None = None
    """[L] fp32 (a list is accepted): log-probs the rollout engine reported, one per response token
    (mismatch metrics, TIS). The loop makes it a tensor once; packing and diagnostics slice it."""
    policy_version: int = 0
    """Weight version that generated the response."""
    reward: float = 0.0
    """Scalar reward R_i."""
    finish_reason: str = "stop"
    """``"stop"`` (EOS or stop token) or ``"length"`` (cut at max_new_tokens)."""
    old_logprobs: torch.Tensor | None = None
    """[L'] fp32: log π_old of the trained response tokens (L' <= L after truncation); actor-filled."""
    ref_logprobs: torch.Tensor | None = None
    """[L'] fp32: log π_ref of the trained response tokens; actor-filled when a reference exists."""
    routed_experts: torch.Tensor | None = None
    """MoE routing replay: ``[P + L - 1, num_layers, top_k]`` int16 experts the engine chose
    (``Completion.routed_experts``); None without replay."""
    group_stats: dict[str, float] = field(default_factory=dict)
    """Per-prompt loss statistics computed over the whole group before packing (e.g.
    ``quatro/lambda``); the actor broadcasts each to the response's tokens (`train/actor/batch_stats.py`)."""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("Sample.prompt_ids must be non-empty (the first response token is "
                             "predicted from the last prompt position)")
        if self.rollout_logprobs is not None and len(self.rollout_logprobs) != len(self.response_ids):
            raise ValueError(f"Sample.rollout_logprobs has {len(self.rollout_logprobs)} entries for "
                             f"{len(self.response_ids)} response tokens")

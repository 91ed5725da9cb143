"""Shared types of the per-token surrogates: the call context, the method output, the ratio.

Every surrogate is a pure function ``fn(cfg, logprobs, old_logprobs, advantages, ctx) -> MethodOutput``
over flat ``[T]`` tensors of one packed micro-batch. It returns the per-token loss (the negated
objective, differentiable in ``logprobs``) and the documented gradient weight ``w`` of
loss-formulas.md §0.2 (``∇loss_t = -w·ρ·Â·∇log π_θ``), which the metrics and the tests use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass(kw_only=True)
class TokenContext:
    """Batch-level inputs a few surrogates need (BAPO's bound search, QUATRO's per-prompt duals).

    Attributes:
        mask: [T] bool, valid response tokens (False tokens are ignored by every statistic).
        seq_ids: [T] int64 or None, response index of each token.
        prompt_ids: [T] int64 or None, prompt (group) index of each token.
        dp_group: process group or None; BAPO SUM-reduces its candidate sums over it.
        batch_stats: statistics computed before this call over whole groups / the whole mini-batch
            (`group_stats.py`): 0-d ``bapo/c_low``, ``bapo/c_high``, ``bapo/pos_share``; [T]
            ``quatro/lambda``. When present they replace the per-call search / solve.
    """

    mask: torch.Tensor
    seq_ids: torch.Tensor | None = None
    prompt_ids: torch.Tensor | None = None
    dp_group: dist.ProcessGroup | None = None
    batch_stats: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(kw_only=True)
class MethodOutput:
    """What a surrogate returns.

    Attributes:
        loss: [T] per-token loss (-J_t), carries gradient to ``logprobs``.
        weight: [T] detached gradient weight ``w`` of the ρ·Â term (§0.2); additive terms
            (QUATRO's stabiliser) are not in it.
        ratio: [T] detached importance ratio ρ after the log-ratio clamp.
        extras: detached method-specific tensors for metrics ([T] per-token or 0-d per batch).
    """

    loss: torch.Tensor
    weight: torch.Tensor
    ratio: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def clamped_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                      clamp: float) -> torch.Tensor:
    """log ρ = clamp(log π_θ - sg[log π_old], ±clamp); [T], gradient flows to ``logprobs`` only.

    The clamp (20 in verl) keeps ``exp`` finite; outside it the token has zero gradient.
    """
    return torch.clamp(logprobs - old_logprobs.detach(), -clamp, clamp)


def dual_clip(loss: torch.Tensor, weight: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor,
              c: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the dual-clip: for Â<0 and ρ>c the loss is the constant -c·Â and w = 0.

    Args:
        loss, weight, ratio, adv: [T] tensors (``ratio`` detached).
        c: dual-clip constant (> 1) or None for no-op.
    """
    if c is None:
        return loss, weight
    hit = (adv < 0) & (ratio > c)
    return torch.where(hit, -c * adv, loss), torch.where(hit, torch.zeros_like(weight), weight)

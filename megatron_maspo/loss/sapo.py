"""SAPO: Soft Adaptive Policy Optimisation (Gao et al. 2025, arXiv 2511.20347; loss-formulas.md §9).

``J = E[f_τ(ρ)·Â]`` with ``f_τ(ρ) = (4/τ)·σ(τ(ρ-1))`` and τ = τ_pos if Â > 0 else τ_neg. The gate is
part of the differentiated surrogate, so ``w = 4s(1-s) = sech²(τ(ρ-1)/2)``, ``s = σ(τ(ρ-1))``: smooth,
bilateral, never exactly 0, w(1) = 1.
"""

from __future__ import annotations

import torch

from megatron_maspo.loss.base import MethodOutput, TokenContext, clamped_log_ratio
from megatron_maspo.loss.config import LossConfig


def sapo_weight(ratio: torch.Tensor, tau: torch.Tensor | float) -> torch.Tensor:
    """SAPO gradient weight ``sech²(τ(ρ-1)/2)``; [T], detached."""
    s = torch.sigmoid(tau * (ratio.detach() - 1.0))
    return 4.0 * s * (1.0 - s)


def sapo(cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor,
         ctx: TokenContext) -> MethodOutput:
    """SAPO per-token loss ``-(4/τ)·σ(τ(ρ-1))·Â``; [T]."""
    ratio = torch.exp(clamped_log_ratio(logprobs, old_logprobs, cfg.log_ratio_clamp))
    # Build τ in the ratio's dtype from the start: torch.where on Python floats makes a float32 tensor
    # (τ_neg = 1.0499999523), which a later .to(float64) cannot undo.
    tau_pos = torch.tensor(cfg.sapo.tau_pos, dtype=ratio.dtype, device=ratio.device)
    tau_neg = torch.tensor(cfg.sapo.tau_neg, dtype=ratio.dtype, device=ratio.device)
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv
    return MethodOutput(loss=loss, weight=sapo_weight(ratio, tau), ratio=ratio.detach())

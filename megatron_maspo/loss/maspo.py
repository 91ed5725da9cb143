"""MASPO: Mass-Adaptive Soft Policy Optimisation (Fu et al. 2026, arXiv 2602.17550).

Objective (§4.1): ``J = E[(1/Σ|o_i|) Σ_{i,t} F_{i,t}·ρ_{i,t}·Â_i]`` with the unilateral Gaussian gate

    F = exp(-(sg[ρ]-1)² / (2σ_pos²))   if Â > 0 and ρ > 1
        exp(-(sg[ρ]-1)² / (2σ_neg²))   if Â < 0 and ρ < 1
        1                              otherwise

and mass-adaptive, risk-adjusted widths (§4.2, App. A.3)

    m     = min(σ_base / p_old^α, σ_cap)          (computed as σ_base·exp(-α·log p_old))
    σ_pos = m · clip(1 + β_high·Â, 0.1, 10)
    σ_neg = m · clip(1 / (1 - β_low·Â), 0.1, 10)

``F`` is detached, so ``∇loss = -F·ρ·Â·∇log π_θ`` (w = F). No hard clip, no dual-clip: an optional
``maspo.safety_cap`` (off by default) zeroes Â<0 tokens with ρ > c, which the paper leaves ungated.
"""

from __future__ import annotations

import torch

from megatron_maspo.loss.base import MethodOutput, TokenContext, clamped_log_ratio, dual_clip
from megatron_maspo.loss.config import LossConfig


def maspo_sigmas(old_logprobs: torch.Tensor, adv: torch.Tensor, cfg: LossConfig
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gate widths of MASPO (App. A.3), all detached [T].

    Args:
        old_logprobs: [T] log π_old of the sampled token (temperature-scaled, trainer-recomputed).
        adv: [T] Â.
        cfg: uses cfg.maspo (sigma_base, alpha, sigma_cap, beta_high, beta_low, risk_min, risk_max).

    Returns:
        (mass m, σ_pos, σ_neg, cap_hit): cap_hit is a bool [T], True where σ_cap bounds m.
    """
    # Log space: p_old = 0 (log = -inf) gives +inf -> capped, never 1/0.
    p = cfg.maspo
    raw = p.sigma_base * torch.exp(-p.alpha * old_logprobs.detach())
    mass = torch.clamp(raw, max=p.sigma_cap)
    s_pos = mass * torch.clamp(1.0 + p.beta_high * adv, p.risk_min, p.risk_max)
    # σ_neg is only used where Â < 0; elsewhere 1 - β_low·Â may reach 0, so substitute 1.
    denom = torch.where(adv < 0, 1.0 - p.beta_low * adv, torch.ones_like(adv))
    s_neg = mass * torch.clamp(1.0 / denom, p.risk_min, p.risk_max)
    return mass, s_pos, s_neg, raw >= p.sigma_cap


def maspo_gate(ratio: torch.Tensor, adv: torch.Tensor, s_pos: torch.Tensor, s_neg: torch.Tensor
               ) -> torch.Tensor:
    """Unilateral Gaussian gate F ∈ (0, 1] (§4.1) on the detached ratio; [T]."""
    r = ratio.detach()
    gate = torch.ones_like(r)
    gate = torch.where((adv > 0) & (r > 1), torch.exp(-(r - 1) ** 2 / (2 * s_pos**2)), gate)
    return torch.where((adv < 0) & (r < 1), torch.exp(-(r - 1) ** 2 / (2 * s_neg**2)), gate)


def maspo(cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor,
          ctx: TokenContext) -> MethodOutput:
    """MASPO per-token loss ``-sg[F]·ρ·Â`` (arXiv 2602.17550 §4.1, App. A.3; loss-formulas.md §13.7).

    Returns:
        MethodOutput with extras ``maspo/sigma`` (σ actually used: σ_pos for Â>0, σ_neg for Â<0,
        m for Â=0) and ``maspo/cap_hit`` (σ_cap binds on m).
    """
    ratio = torch.exp(clamped_log_ratio(logprobs, old_logprobs, cfg.log_ratio_clamp))
    mass, s_pos, s_neg, cap_hit = maspo_sigmas(old_logprobs, adv, cfg)
    gate = maspo_gate(ratio, adv, s_pos, s_neg)
    loss, w = dual_clip(-gate * ratio * adv, gate, ratio.detach(), adv, cfg.maspo.safety_cap)
    sigma = torch.where(adv > 0, s_pos, torch.where(adv < 0, s_neg, mass))
    return MethodOutput(loss=loss, weight=w, ratio=ratio.detach(),
                        extras={"maspo/sigma": sigma, "maspo/cap_hit": cap_hit})

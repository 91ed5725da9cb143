"""PPO-clip surrogates: GRPO, Clip-Higher (DAPO), DAC (DCPO), CISPO and (CE-)GPPO.

All written as the negated objective per token (loss-formulas.md §3, §5, §6, §10, §11); the gradient
weight ``w`` of each is returned next to the loss (``∇loss = -w·ρ·Â·∇log π_θ``).
"""

from __future__ import annotations

import torch

from megatron_maspo.loss.base import MethodOutput, TokenContext, clamped_log_ratio, dual_clip
from megatron_maspo.loss.config import LossConfig


def ppo_clip_loss(ratio: torch.Tensor, adv: torch.Tensor, low: torch.Tensor | float,
                  high: torch.Tensor | float, dual_c: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss ``max(-ρ·Â, -clip(ρ, low, high)·Â)`` with optional dual-clip.

    Args:
        ratio: [T] ρ with gradient.
        adv: [T] Â (detached).
        low, high: ratio bounds (scalars or detached [T] tensors), e.g. 1-ε_low and 1+ε_high.
        dual_c: dual-clip constant for Â<0 (None = off).

    Returns:
        (loss [T], w [T]): "PPO-clip(low, high)" of loss-formulas.md §15: Â>0: w = 1 iff ρ ≤ high;
        Â<0: w = 1 iff ρ ≥ low (and ρ ≤ dual_c).
    """
    r = ratio.detach()
    low_t = torch.as_tensor(low, dtype=ratio.dtype, device=ratio.device)
    high_t = torch.as_tensor(high, dtype=ratio.dtype, device=ratio.device)
    clipped = torch.minimum(torch.maximum(ratio, low_t), high_t)
    loss = torch.maximum(-ratio * adv, -clipped * adv)
    keep = torch.where(adv > 0, r <= high_t, torch.where(adv < 0, r >= low_t, torch.ones_like(r, dtype=torch.bool)))
    return dual_clip(loss, keep.to(ratio.dtype), r, adv, dual_c)


def grpo(cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor,
         ctx: TokenContext) -> MethodOutput:
    """GRPO / PPO-clip (DeepSeekMath; loss-formulas.md §3): band [1-ε_low, 1+ε_high], optional dual-clip.

    Used for both 'grpo' (ε_low = ε_high = ε) and 'clip_higher' (DAPO's decoupled ε's, §5).
    """
    p = cfg.params  # cfg.grpo or cfg.clip_higher
    ratio = torch.exp(clamped_log_ratio(logprobs, old_logprobs, cfg.log_ratio_clamp))
    loss, w = ppo_clip_loss(ratio, adv, 1.0 - p.eps_low, 1.0 + p.eps_high, p.dual_clip_c)
    return MethodOutput(loss=loss, weight=w, ratio=ratio.detach())


def dac_bounds(old_logprobs: torch.Tensor, eps_low: float, eps_high: float, upper_cap: float,
               p_old_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DCPO's dynamic-adaptive clip bounds (arXiv 2509.02333; loss-formulas.md §6).

    ``L = ½ + ½·sqrt(max(1 - 4ε_low/p_old, 0))``, ``U = min(½ + ½·sqrt(1 + 4ε_high/p_old), upper_cap)``,
    from ``|ρ(ρ-1)|·p_old ≤ ε``. ``p_old = exp(old_logprobs)`` floored at ``p_old_floor``.

    Returns:
        (L, U): detached [T] ratio bounds.
    """
    p_old = torch.exp(old_logprobs.detach()).clamp_min(p_old_floor)
    low = 0.5 + 0.5 * torch.sqrt(torch.clamp(1.0 - 4.0 * eps_low / p_old, min=0.0))
    high = torch.clamp(0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * eps_high / p_old), max=upper_cap)
    return low, high


def dac(cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor,
        ctx: TokenContext) -> MethodOutput:
    """DAC: PPO-clip with bounds [L(p_old), U(p_old)] (DCPO; loss-formulas.md §6)."""
    ratio = torch.exp(clamped_log_ratio(logprobs, old_logprobs, cfg.log_ratio_clamp))
    p = cfg.dac
    low, high = dac_bounds(old_logprobs, p.eps_low, p.eps_high, p.upper_cap, p.p_old_floor)
    loss, w = ppo_clip_loss(ratio, adv, low, high, p.dual_clip_c)
    return MethodOutput(loss=loss, weight=w, ratio=ratio.detach(),
                        extras={"dac/low": low, "dac/high": high})


def cispo(cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor,
          ctx: TokenContext) -> MethodOutput:
    """CISPO (MiniMax-M1 §3.1; loss-formulas.md §10): ``-sg[min(ρ, 1+ε_high)]·Â·log π_θ``.

    No token is dropped; ``w = clip(ρ)/ρ``: 1 for every ρ ≤ 1+ε_high (no lower bound by default,
    MiniMax-M1 §3.1), or ``max(ρ, 1-ε_low)`` below when ``cispo.eps_low`` is set. The forward value
    uses log π_θ as in the paper/verl.
    """
    r = torch.exp(clamped_log_ratio(logprobs, old_logprobs, cfg.log_ratio_clamp).detach())
    low = None if cfg.cispo.eps_low is None else 1.0 - cfg.cispo.eps_low
    clipped = torch.clamp(r, min=low, max=1.0 + cfg.cispo.eps_high)
    # ρ only enters detached here, so the log-ratio clamp changes nothing but the logged ratio.
    loss = -clipped * adv * logprobs
    return MethodOutput(loss=loss, weight=clipped / r, ratio=r)


def gppo(cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor,
         ctx: TokenContext) -> MethodOutput:
    """(CE-)GPPO (Klear-Reasoner; loss-formulas.md §11): gradient-preserving clipping.

    Â<0, ρ<1-ε_low: ``-β₁(1-ε_low)/sg[ρ]·ρ·Â`` (w = β₁(1-ε_low)/ρ); Â>0, ρ>1+ε_high:
    ``-β₂(1+ε_high)/sg[ρ]·ρ·Â`` (w = β₂(1+ε_high)/ρ); otherwise ``-ρ·Â`` (w = 1); dual-clip optional.
    """
    ratio = torch.exp(clamped_log_ratio(logprobs, old_logprobs, cfg.log_ratio_clamp))
    r = ratio.detach()
    p = cfg.gppo
    low, high = 1.0 - p.eps_low, 1.0 + p.eps_high
    w = torch.ones_like(r)
    w = torch.where((adv < 0) & (r < low), p.beta_low * low / r, w)
    w = torch.where((adv > 0) & (r > high), p.beta_high * high / r, w)
    loss, w = dual_clip(-w * ratio * adv, w, r, adv, p.dual_clip_c)
    return MethodOutput(loss=loss, weight=w, ratio=r)

"""BAPO: Balanced Policy Optimisation with adaptive clipping (Xi et al. 2025, arXiv 2510.18927).

PPO-clip with explicit ratio bounds ``[c_low, c_high]`` searched once per call, before the gradient
step, so that positive-advantage tokens carry at least a share ρ₀ of the (detached) contribution
(Eq. 8, Alg. 1; loss-formulas.md §8):

    P(c_high) = Σ_{Â>0} |Â|·min(ρ, c_high),   N(c_low) = Σ_{Â<0} |Â|·max(ρ, c_low)
    raise c_high by δ₁ (up to b⁺), then c_low by δ₂ (up to b⁻), while P/(P+N) < ρ₀

Every candidate's P and N are computed in one vectorised pass and SUM-reduced over ``dp_group`` in a
single all-reduce (not one per search step), so all DP ranks pick the same bounds. The trainer searches
once per mini-batch at the current policy (`group_stats.mini_batch_stats`, ``bapo.scope='mini_batch'``)
and passes the bounds in ``ctx.batch_stats``; without them the loss searches on this call's tokens
(``'micro_batch'``, the official code's behaviour).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_maspo.loss.base import MethodOutput, TokenContext, clamped_log_ratio
from megatron_maspo.loss.config import BAPO_METHODS, LossConfig
from megatron_maspo.loss.ppo import ppo_clip_loss
from megatron_maspo.parallel import comm


def _grid(lo: float, hi: float, step: float, like: torch.Tensor) -> torch.Tensor:
    n = int((hi - lo) / step + 1e-9) + 1
    return lo + step * torch.arange(n, dtype=like.dtype, device=like.device)


def bapo_search_bounds(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: LossConfig,
                       dp_group: dist.ProcessGroup | None = None) -> tuple[float, float, float]:
    """Search BAPO's ratio bounds (Alg. 1) on detached statistics.

    Args:
        ratio: [T] ρ (detached inside).
        adv: [T] Â.
        mask: [T] bool, valid tokens.
        cfg: uses ``cfg.params`` (cfg.bapo or cfg.bapo_code: target, ranges, steps, contribution,
            order).
        dp_group: if given, candidate sums are SUM-all-reduced over it (one collective).

    Returns:
        (c_low, c_high, share) with share the positive share reached at the returned bounds.
    """
    p = cfg.params if cfg.method in BAPO_METHODS else cfg.bapo  # another method: the paper's group
    r = ratio.detach()
    a_abs = adv.detach().abs() * mask
    pos, neg = (adv > 0) & mask, (adv < 0) & mask
    highs = _grid(*p.high_range, p.step_high, r)
    lows = _grid(*p.low_range, p.step_low, r)
    p_k = (torch.where(pos, a_abs, 0)[:, None] * torch.minimum(r[:, None], highs)).sum(0)
    if p.contribution == "loss_value":
        n_j = (torch.where(neg, a_abs, 0)[:, None] * torch.maximum(r[:, None], lows)).sum(0)
    else:  # gradient_mass: only negatives that still carry gradient (ρ ≥ c_low) count
        n_j = (torch.where(neg, a_abs * r, 0)[:, None] * (r[:, None] >= lows)).sum(0)
    sums = torch.cat([p_k, n_j])
    if dp_group is not None:
        comm.all_reduce(sums, group=dp_group)
    p_k, n_j = sums[: len(highs)].tolist(), sums[len(highs):].tolist()

    def share(i: int, j: int) -> float:
        tot = p_k[i] + n_j[j]
        return 1.0 if tot <= 0 else p_k[i] / tot

    # Raise the preferred bound until it is exhausted, then the other, until the share is reached.
    # Both grids are walked to their ends (a single-point range must not stop the other bound).
    i = j = 0
    target = p.share_threshold
    while share(i, j) < target:
        can_high, can_low = i + 1 < len(highs), j + 1 < len(lows)
        if not (can_high or can_low):
            break
        if (p.order == "high_first" and can_high) or not can_low:
            i += 1
        else:
            j += 1
    return float(lows[j]), float(highs[i]), share(i, j)


def bapo(cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor,
         ctx: TokenContext) -> MethodOutput:
    """BAPO per-token loss: PPO-clip(c_low, c_high) with the searched bounds (+ optional dual-clip)."""
    ratio = torch.exp(clamped_log_ratio(logprobs, old_logprobs, cfg.log_ratio_clamp))
    keys = ("bapo/c_low", "bapo/c_high", "bapo/pos_share")
    if keys[0] in ctx.batch_stats:  # searched once over the whole mini-batch (no host sync here)
        vals = [ctx.batch_stats[k].to(device=ratio.device, dtype=ratio.dtype) for k in keys]
    else:
        found = bapo_search_bounds(ratio, adv, ctx.mask, cfg, ctx.dp_group)
        vals = [torch.tensor(v, dtype=ratio.dtype, device=ratio.device) for v in found]
    loss, w = ppo_clip_loss(ratio, adv, vals[0], vals[1], cfg.params.dual_clip_c)
    return MethodOutput(loss=loss, weight=w, ratio=ratio.detach(), extras=dict(zip(keys, vals)))

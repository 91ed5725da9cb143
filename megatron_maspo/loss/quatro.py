"""QUATRO-reconstruction: query-adaptive trust region (arXiv 2602.04620).

**This is a reconstruction** from the abstract and a third-party summary (loss-formulas.md §14); no code
and no author list is available to us. Only "query-adaptive trust region, enforced directly" is from the
abstract; the Lagrangian / per-prompt duals / log-ratio stabiliser follow the summary; the rest is ours.
Report results as "QUATRO-reconstruction". Per prompt q, the Lagrangian of
``max E_old[ρ·Â] s.t. D_q ≤ δ_q`` gives the token objective (§14.2)

    J_t = ρ·Â - sg[λ_q]·D(ρ)

with the stabiliser ``D`` chosen by ``quatro.divergence``:

    kl_new_old  D = ρ·log ρ           ∇loss = -ρ·(Â - λ(1 + log ρ))·∇log π
                (drop_zero_mean_term: D = ρ·log ρ - ρ + 1, the zero-mean '+1' removed)
    kl_old_new  D = -log ρ            ∇loss = -(ρ·Â + λ)·∇log π
    k3          D = ρ - 1 - log ρ     ∇loss = -(ρ·Â - λ(ρ - 1))·∇log π

It is additive, so it acts on degenerate groups (Â = 0) too. The dual variable λ_q per prompt comes
from ``quatro.dual_solver``: 'reps_closed_form' (the default, last below), 'fixed' (λ_init, not
query-adaptive), 'dual_ascent' (one projected step
``clip(λ_init + η·(D̂_q - δ), λ_min, λ_max)`` with D̂_q the prompt's mean detached D over this call's
tokens; a stateful controller across steps belongs to the trainer), or 'reps_closed_form'
(``argmin_λ λδ + λ·log mean_j exp(Â_j/λ)`` over the prompt's responses, on a log-spaced grid).
The trainer computes λ_q over the whole group before the loss calls (`group_stats.py`: REPS from all
G advantages at rollout time, dual ascent from all the prompt's tokens of the mini-batch) and passes it
per token in ``ctx.batch_stats['quatro/lambda']``; without it λ_q uses this call's tokens only.
"""

from __future__ import annotations

import math

import torch

from megatron_maspo.loss.base import MethodOutput, TokenContext, clamped_log_ratio
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.loss.ppo import ppo_clip_loss

_REPS_GRID = 256


def quatro_divergence(log_ratio: torch.Tensor, kind: str, drop_zero_mean_term: bool) -> torch.Tensor:
    """Per-token stabiliser D(ρ) of the reconstruction; [T], differentiable in ``log_ratio``."""
    ratio = torch.exp(log_ratio)
    if kind == "kl_new_old":
        d = ratio * log_ratio
        return d - ratio + 1.0 if drop_zero_mean_term else d
    if kind == "kl_old_new":
        return -log_ratio
    if kind == "k3":
        return ratio - 1.0 - log_ratio
    raise ValueError(f"quatro.divergence={kind!r}; accepted: kl_new_old, kl_old_new, k3")


def _per_prompt_mean(x: torch.Tensor, prompt_idx: torch.Tensor, n: int, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    num = torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, prompt_idx, x * m)
    den = torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, prompt_idx, m)
    return num / den.clamp_min(1.0)


def reps_lambda(adv_S: torch.Tensor, prompt_of_seq: torch.Tensor, n_prompts: int, cfg: LossConfig
                ) -> torch.Tensor:
    """Per-prompt REPS dual ``argmin_{λ} λ·δ + λ·log((1/G) Σ_j exp(Â_j/λ))`` on a log grid.

    Args:
        adv_S: [S] advantage of each response.
        prompt_of_seq: [S] int64 prompt index in [0, n_prompts).
        cfg: cfg.quatro.delta, lambda_min (floored at 1e-4 for the grid), lambda_max.

    Returns:
        [n_prompts] λ_q (detached).
    """
    lo = max(cfg.quatro.lambda_min, 1e-4)
    lam = torch.logspace(math.log10(lo), math.log10(cfg.quatro.lambda_max), _REPS_GRID,
                         dtype=adv_S.dtype, device=adv_S.device)                       # [K]
    z = adv_S[:, None] / lam[None, :]                                                # [S, K]
    zmax = torch.full((n_prompts, _REPS_GRID), -math.inf, dtype=z.dtype, device=z.device)
    zmax = zmax.scatter_reduce(0, prompt_of_seq[:, None].expand_as(z), z, "amax")
    sums = torch.zeros_like(zmax).index_add_(0, prompt_of_seq, torch.exp(z - zmax[prompt_of_seq]))
    count = torch.zeros(n_prompts, dtype=z.dtype, device=z.device).index_add_(
        0, prompt_of_seq, torch.ones_like(adv_S))
    log_mean = zmax + torch.log(sums) - torch.log(count.clamp_min(1.0))[:, None]
    dual = lam * cfg.quatro.delta + lam * log_mean                                   # [P, K]
    return lam[dual.argmin(dim=1)]


def _lambdas(cfg: LossConfig, d: torch.Tensor, adv: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
    """λ_q broadcast to tokens; [T] detached."""
    if cfg.quatro.dual_solver == "fixed":
        return torch.full_like(adv, cfg.quatro.lambda_init)
    if "quatro/lambda" in ctx.batch_stats:
        return ctx.batch_stats["quatro/lambda"].to(adv.dtype).detach()
    if ctx.prompt_ids is None:
        raise ValueError(f"quatro.dual_solver={cfg.quatro.dual_solver!r} needs prompt_ids [T]")
    uniq, p_idx = torch.unique(ctx.prompt_ids, return_inverse=True)
    if cfg.quatro.dual_solver == "dual_ascent":
        d_hat = _per_prompt_mean(d.detach(), p_idx, len(uniq), ctx.mask)
        lam = torch.clamp(cfg.quatro.lambda_init + cfg.quatro.lambda_lr * (d_hat - cfg.quatro.delta),
                          cfg.quatro.lambda_min, cfg.quatro.lambda_max)
        return lam[p_idx]
    if ctx.seq_ids is None:
        raise ValueError("quatro.dual_solver='reps_closed_form' needs seq_ids [T]")
    valid = ctx.mask
    s_uniq, s_idx = torch.unique(ctx.seq_ids[valid], return_inverse=True)
    adv_S = torch.zeros(len(s_uniq), dtype=adv.dtype, device=adv.device).scatter_reduce(
        0, s_idx, adv[valid].detach(), "mean", include_self=False)
    prompt_of_seq = torch.zeros(len(s_uniq), dtype=torch.long, device=adv.device).scatter_reduce(
        0, s_idx, p_idx[valid], "amax", include_self=False)
    return reps_lambda(adv_S, prompt_of_seq, len(uniq), cfg)[p_idx]


def quatro(cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor,
           ctx: TokenContext) -> MethodOutput:
    """QUATRO-reconstruction per-token loss ``-(ρ·Â - sg[λ_q]·D(ρ))`` (optionally PPO-clipped ρ·Â).

    Returns:
        MethodOutput; ``weight`` is the w of the ρ·Â part only (1, or PPO-clip's), the stabiliser is
        additive. Extras: ``quatro/lambda`` [T], ``quatro/divergence`` [T] (detached D).
    """
    log_ratio = clamped_log_ratio(logprobs, old_logprobs, cfg.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    if cfg.quatro.keep_ratio_clip:
        q = cfg.quatro
        pg, w = ppo_clip_loss(ratio, adv, 1.0 - q.eps_low, 1.0 + q.eps_high, q.dual_clip_c)
    else:
        pg, w = -ratio * adv, torch.ones_like(adv)
    d = quatro_divergence(log_ratio, cfg.quatro.divergence, cfg.quatro.drop_zero_mean_term)
    lam = _lambdas(cfg, d, adv, ctx)
    return MethodOutput(loss=pg + lam * d, weight=w, ratio=ratio.detach(),
                        extras={"quatro/lambda": lam, "quatro/divergence": d.detach()})

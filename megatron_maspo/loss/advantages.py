"""Advantage estimators (loss-formulas.md §1) and per-token advantage modifiers (§7, §12.2).

Group estimators are pure functions of ``rewards_P_G`` ([P prompts, G responses], float) returning
``advantages_P_G``; the trainer broadcasts each response's advantage to its tokens.
"""

from __future__ import annotations

import torch

from megatron_maspo.loss.config import LossConfig


def grpo_advantages(rewards_P_G: torch.Tensor, *, std_unbiased: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO group standardisation ``Â = (R - mean R) / (std R + ε_A)`` (DeepSeekMath; verl).

    A group of size 1 gets mean 0 and std 1 (verl); degenerate groups (all equal) give Â = 0.
    """
    if rewards_P_G.shape[1] == 1:
        return rewards_P_G / (1.0 + eps)
    mean = rewards_P_G.mean(dim=1, keepdim=True)
    std = rewards_P_G.std(dim=1, keepdim=True, correction=1 if std_unbiased else 0)
    return (rewards_P_G - mean) / (std + eps)


def drgrpo_advantages(rewards_P_G: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO mean-only advantage ``Â = R - mean R`` (Liu et al. 2025)."""
    return rewards_P_G - rewards_P_G.mean(dim=1, keepdim=True)


def rloo_advantages(rewards_P_G: torch.Tensor) -> torch.Tensor:
    """Leave-one-out ``Â_i = R_i - mean_{j≠i} R_j = G/(G-1)·(R_i - mean R)``; needs G ≥ 2."""
    g = rewards_P_G.shape[1]
    if g < 2:
        raise ValueError(f"rloo needs a group size G >= 2, got rewards_P_G of shape {tuple(rewards_P_G.shape)}")
    return (rewards_P_G - rewards_P_G.mean(dim=1, keepdim=True)) * (g / (g - 1))


def compute_advantages(cfg: LossConfig, rewards_P_G: torch.Tensor) -> torch.Tensor:
    """Outcome advantages for ``cfg.advantage`` in {'grpo', 'drgrpo', 'rloo'}.

    Args:
        cfg: uses advantage, std_unbiased, eps_adv.
        rewards_P_G: [P, G] float rewards (e.g. ±1 from math-verify).

    Returns:
        [P, G] advantages, same dtype.
    """
    if rewards_P_G.dim() != 2 or not rewards_P_G.is_floating_point():
        raise ValueError(f"rewards_P_G must be a float [P, G] tensor, got {rewards_P_G.dtype} "
                         f"shape {tuple(rewards_P_G.shape)}")
    if not torch.isfinite(rewards_P_G).all():
        raise ValueError("rewards_P_G has non-finite values")
    if cfg.advantage == "grpo":
        return grpo_advantages(rewards_P_G, std_unbiased=cfg.std_unbiased, eps=cfg.eps_adv)
    if cfg.advantage == "drgrpo":
        return drgrpo_advantages(rewards_P_G)
    return rloo_advantages(rewards_P_G)


def entropy_advantage(adv_T: torch.Tensor, entropy_T: torch.Tensor, coef: float,
                      kappa: float) -> torch.Tensor:
    """Entropy Advantage (arXiv 2506.14758): ``Â' = Â + min(α·sg[H], |Â|/κ)``; [T].

    Inside the clip band ``w = 1 + ψ/Â``; Â = 0 stays 0 (cannot revive degenerate groups).
    """
    return adv_T + torch.minimum(coef * entropy_T.detach(), adv_T.abs() / kappa)


def reweight_advantage(adv_T: torch.Tensor, old_logprobs_T: torch.Tensor, alpha: float) -> torch.Tensor:
    """Advantage Reweighting (arXiv 2505.12929): ``Â' = (α_A·sg[p_old] + 1 - α_A)·Â``; [T]."""
    return (alpha * torch.exp(old_logprobs_T.detach()) + 1.0 - alpha) * adv_T

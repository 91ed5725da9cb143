"""KL-to-reference estimators (the rollout correction, TIS included, is in `rollout_correction.py`)."""

from __future__ import annotations

import torch


def kl_to_reference(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimator of KL(π_θ ‖ π_ref) on sampled tokens; [T], gradient through ``logprobs``.

    k1 = log π_θ - log π_ref; k2 = ½(log π_θ - log π_ref)²; k3 = r - log r - 1 with
    r = π_ref/π_θ (DeepSeekMath's D_k3, loss-formulas.md §3; verl 'low_var_kl': log r clamped to ±20
    and the value to [-10, 10]).
    """
    log_r = ref_logprobs.detach() - logprobs
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        log_r = torch.clamp(log_r, -20.0, 20.0)
        return torch.clamp(torch.exp(log_r) - log_r - 1.0, -10.0, 10.0)
    raise ValueError(f"kl_type={kind!r}; accepted: k1, k2, k3")


def approx_kl_old_new(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(π_old ‖ π_θ) per token, ``ρ - 1 - log ρ`` ≥ 0; [T], detached."""
    lr = log_ratio.detach()
    return torch.exp(lr) - 1.0 - lr

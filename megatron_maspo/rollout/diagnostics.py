"""Train-vs-rollout mismatch diagnostics (weight-sync-notes.md §2: slime's logprob abs diff, NeMo-RL's token_mult_prob_error).

With ``Δ_t = log p_train(y_t) - log p_rollout(y_t)`` over the masked response tokens:

- ``mismatch/logprob_abs_diff_mean`` = mean |Δ|, ``mismatch/logprob_abs_diff_max`` = max |Δ|;
- ``mismatch/prob_ratio_err_mean`` = mean |exp(Δ) - 1| (token probability ratio error);
- ``mismatch/prob_ratio_mean`` = mean exp(Δ) (NeMo-RL's ``token_mult_prob_error``-style ratio);
- ``mismatch/kl_k1`` = mean(-Δ), an unbiased estimate of KL(rollout || train) (tokens drawn from the rollout
  policy); ``mismatch/kl_k3`` = mean(exp(Δ) - 1 - Δ), Schulman's low-variance, always >= 0 estimator of the
  same KL.

All means are token means over ``mask``; pass ``num_tokens_global`` (and reduce with a SUM all-reduce) to get
DP-global means, following the loss's convention of pre-divided numerators.
"""

from __future__ import annotations

import torch

from megatron_maspo.rollout.types import Completion


def mismatch_metrics(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                     num_tokens_global: int | float | torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Token-level mismatch between trainer-recomputed and rollout-engine log-probs.

    Args:
        train_logprobs: [T] fp32, trainer log-probs of the sampled tokens at the rollout temperature.
        rollout_logprobs: [T] fp32, the engine's log-probs of the same tokens.
        mask: [T] bool/float, 1 on response tokens.
        num_tokens_global: divisor for the means; defaults to ``mask.sum()`` (local means). With it, the
            ``*_mean`` / ``kl_*`` values are SUM-reducible numerators; ``*_max`` is MAX-reducible.

    Returns:
        Scalar fp32 tensors keyed ``mismatch/...`` (see module docstring).
    """
    if train_logprobs.shape != rollout_logprobs.shape or train_logprobs.shape != mask.shape:
        raise ValueError(f"shapes differ: train_logprobs {tuple(train_logprobs.shape)}, rollout_logprobs "
                         f"{tuple(rollout_logprobs.shape)}, mask {tuple(mask.shape)}")
    m = mask.float()
    denom = m.sum() if num_tokens_global is None else torch.as_tensor(num_tokens_global, dtype=torch.float32)
    denom = denom.clamp_min(1.0)
    delta = (train_logprobs.float() - rollout_logprobs.float()) * m  # masked tokens contribute Δ = 0
    ratio = delta.exp()
    return {
        "mismatch/logprob_abs_diff_mean": (delta.abs() * m).sum() / denom,
        "mismatch/logprob_abs_diff_max": (delta.abs() * m).max() if m.numel() else torch.zeros(()),
        "mismatch/prob_ratio_err_mean": ((ratio - 1).abs() * m).sum() / denom,
        "mismatch/prob_ratio_mean": (ratio * m).sum() / denom,
        "mismatch/kl_k1": (-delta * m).sum() / denom,
        "mismatch/kl_k3": ((ratio - 1 - delta) * m).sum() / denom,
    }


def rollout_logprobs_tensor(completions: list[Completion]) -> list[torch.Tensor]:
    """Per-sample rollout log-probs as fp32 [len_i] tensors, kept for the loss's IS correction
    (``compute_policy_loss(..., rollout_logprobs=...)``, loss-formulas.md)."""
    out = []
    for c in completions:
        if len(c.logprobs) != len(c.token_ids):
            raise ValueError(f"completion has {len(c.token_ids)} tokens but {len(c.logprobs)} log-probs")
        out.append(torch.tensor(c.logprobs, dtype=torch.float32))
    return out

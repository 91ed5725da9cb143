"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071; loss-formulas.md §17).

The importance ratio is the length-normalised sequence likelihood ratio (GSPO §4.1, Eq. for s_i)

    s_i = exp( (1/|y_i|) Σ_t (log π_θ(y_i,t) - log π_old(y_i,t)) )

clipped per sequence to [1-ε_low, 1+ε_high] (3e-4 / 4e-4, GSPO §5.1). We implement the token-level
form GSPO-token (§4.3): per token

    s_i,t = sg[s_i] · π_θ(y_i,t) / sg[π_θ(y_i,t)]        (value s_i, ∇s_i,t = s_i·∇log π_θ(y_i,t))
    ℓ_t   = -min(s_i,t·Â_i,t, clip(s_i,t, 1-ε_low, 1+ε_high)·Â_i,t)

aggregated seq-mean-token-mean, (1/G) Σ_i (1/|y_i|) Σ_t. With Â_i,t = Â_i (outcome advantages) its
gradient equals GSPO's (§4.3), and it still accepts per-token advantages (Entropy Advantage,
Advantage Reweighting). Clipping is a per-sequence decision: all tokens of a clipped sequence get w = 0.

Exactness: s_i needs all of a response's tokens. The trainer packs whole responses into one
micro-batch (`train/actor/packing.py`: a response is never split; CP > 1 is refused), so each loss call sees
every token of each of its responses and s_i is exact under micro-batching and DP without a collective.
"""

from __future__ import annotations

import torch

from megatron_maspo.loss.base import MethodOutput, TokenContext
from megatron_maspo.loss.config import LossConfig


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """Mean log-ratio of each token's response over its valid tokens, broadcast to tokens.

    Args:
        log_ratio: [T] log π_θ - log π_old (may carry gradient).
        mask: [T] bool, valid tokens (only they enter the mean).
        seq_ids: [T] int64, response index of each token.

    Returns:
        [T] (1/|y_i|) Σ_{t∈i, valid} log_ratio_t, differentiable in ``log_ratio``; 0 for a response
        with no valid token.
    """
    uniq, idx = torch.unique(seq_ids, return_inverse=True)
    m = mask.to(log_ratio.dtype)
    total = torch.zeros(len(uniq), dtype=log_ratio.dtype, device=log_ratio.device).index_add(
        0, idx, log_ratio * m)
    count = torch.zeros(len(uniq), dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, idx, m)
    return (total / count.clamp_min(1.0))[idx]


def gspo(cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor,
         ctx: TokenContext) -> MethodOutput:
    """GSPO-token per-token loss (arXiv 2507.18071 §4.3); needs ``ctx.seq_ids``.

    Returns:
        MethodOutput: ``ratio`` is the token's GSPO-token ratio s_i,t (value s_i, the same for every
        token of a response), ``weight`` the gate w ∈ {0, 1} with ∇ℓ_t = -w·s_i·Â·∇log π_θ;
        extras ``gspo/seq_log_ratio`` [T] (log s_i, detached).
    """
    if ctx.seq_ids is None:
        raise ValueError("loss.method='gspo' needs seq_ids [T] (the response index of each token)")
    p = cfg.gspo
    token_lr = logprobs - old_logprobs.detach()
    # Clamp the sequence's mean log-ratio, not the tokens: s_i is what gets exponentiated.
    seq_lr = torch.clamp(sequence_log_ratio(token_lr, ctx.mask, ctx.seq_ids).detach(),
                         -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    # value exp(seq_lr); gradient s_i·∇log π_θ(y_t) through the token's own log-prob only
    ratio = torch.exp(seq_lr + logprobs - logprobs.detach())
    r = ratio.detach()
    low, high = 1.0 - p.eps_low, 1.0 + p.eps_high
    loss = torch.maximum(-ratio * adv, -torch.clamp(ratio, low, high) * adv)
    keep = torch.where(adv > 0, r <= high, torch.where(adv < 0, r >= low, torch.ones_like(r, dtype=torch.bool)))
    return MethodOutput(loss=loss, weight=keep.to(r.dtype), ratio=r, extras={"gspo/seq_log_ratio": seq_lr})

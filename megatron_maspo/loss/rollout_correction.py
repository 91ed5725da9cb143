"""Trainer/rollout-engine mismatch correction (loss-formulas.md §18), one factor for every method.

With k_t = π_old(t) / π_rollout(t) (trainer-recomputed over engine log-probs, both detached), the
per-token surrogate loss of any method is multiplied by a detached factor c_t:

    tis         c_t = min(k_t, C)                                   truncated IS
    token_mask  c_t = 1[lower ≤ k_t ≤ upper]                        token rejection (verl token_k1), no IS
    icepop      c_t = k_t · 1[lower ≤ k_t ≤ upper]                  IcePop (two-sided mask, kept k as IS)
    seq_mask    c_t = 1[lower ≤ exp(mean_{t'∈i} log k_t') ≤ upper]  geometric-mean rejection (verl Geo-RS)

The sequence statistic needs all of a response's tokens in the call, which the trainer guarantees
(`train/actor/packing.py` never splits a response). Dropped tokens keep their place in the aggregation's
denominators (N or S counted before the first forward), as in IcePop's objective; verl drops rejected
tokens from its response mask instead, so with the same kept tokens our gradient is N_kept/N times
verl's token-mean gradient (sources and defaults: `params.py::RolloutCorrectionParams`).
"""

from __future__ import annotations

import torch

from megatron_maspo.loss.gspo import sequence_log_ratio
from megatron_maspo.loss.params import RolloutCorrectionParams

_LOG_CLAMP = 20.0


def mismatch_log_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    """log k_t = log π_old - log π_rollout, detached and clamped to ±20 (exp stays finite); [T]."""
    return torch.clamp(old_logprobs.detach() - rollout_logprobs.detach(), -_LOG_CLAMP, _LOG_CLAMP)


def correction_factor(p: RolloutCorrectionParams, old_logprobs: torch.Tensor,
                      rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                      seq_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The detached factor c_t of ``p.mode`` and the tokens it drops.

    Args:
        p: the ``loss.rollout_correction`` group (mode != 'none').
        old_logprobs, rollout_logprobs: [T] log π_old and the engine's log-probs.
        mask: [T] bool, valid tokens (the sequence mean runs over them only).
        seq_ids: [T] int64 response index (needed by 'seq_mask').

    Returns:
        (c [T], dropped [T] bool): dropped marks tokens the band rejects (all False for 'tis').
    """
    log_k = mismatch_log_ratio(old_logprobs, rollout_logprobs)
    k = torch.exp(log_k)
    if p.mode == "tis":
        return torch.clamp(k, max=p.cap), torch.zeros_like(mask, dtype=torch.bool)
    lo, hi = p.band()
    if p.mode == "seq_mask":
        if seq_ids is None:
            raise ValueError("loss.rollout_correction.mode='seq_mask' needs seq_ids [T]")
        stat = torch.exp(sequence_log_ratio(log_k, mask.bool(), seq_ids))
    elif p.mode in ("token_mask", "icepop"):
        stat = k
    else:
        raise ValueError(f"loss.rollout_correction.mode={p.mode!r} has no correction factor")
    keep = (stat >= lo) & (stat <= hi)
    c = keep.to(k.dtype) * (k if p.mode == "icepop" else 1.0)
    return c, ~keep


def correction_metrics(p: RolloutCorrectionParams, c: torch.Tensor, dropped: torch.Tensor,
                       mask: torch.Tensor, n_glob: float) -> dict[str, torch.Tensor]:
    """Detached metrics, pre-divided by the global token count N (SUM-reducible, `metrics.py`).

    ``rollout_corr/masked_frac`` (tokens dropped / N), ``rollout_corr/weight_mean`` (Σc/N);
    for 'tis' also the historical ``tis/weight_mean`` and ``tis/truncated_frac``.
    """
    m = mask.to(c.dtype)
    met = {"rollout_corr/masked_frac": (dropped.to(c.dtype) * m).sum() / n_glob,
           "rollout_corr/weight_mean": (c * m).sum() / n_glob}
    if p.mode == "tis":
        met["tis/weight_mean"] = met["rollout_corr/weight_mean"]
        met["tis/truncated_frac"] = ((c >= p.cap).to(c.dtype) * m).sum() / n_glob
    return met

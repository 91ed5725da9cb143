"""Exact loss aggregation with global counts (loss-formulas.md §2).

Each micro-batch returns ``Σ_local (unit-normalised ℓ) / N_unit_glob``; summing that over all
micro-batches and SUM-reducing over DP gives exactly the paper's mini-batch loss, however the tokens are
split. ``N_unit_glob`` is the global token count (token-mean) or response count (seq-* modes), counted
before the first forward (masks are known up front) with one SUM all-reduce over DP×CP.

Sequences must not be split across calls (each call sees a response's full length |o_i|).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_maspo.loss.inputs import LossInputs


def seq_token_counts(mask: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """|o_i| of each token's response, broadcast to tokens; [T] float (mask's valid tokens only)."""
    uniq, idx = torch.unique(seq_ids, return_inverse=True)
    counts = torch.zeros(len(uniq), dtype=torch.float64, device=mask.device).index_add_(
        0, idx, mask.to(torch.float64))
    return counts[idx]


def local_units(mode: str, mask: torch.Tensor, seq_ids: torch.Tensor | None) -> int:
    """Number of aggregation units in this call: valid tokens (token-mean) or responses with ≥1 valid
    token (seq-* modes). Summed over micro-batches and DP ranks it is the global count."""
    if mode == "token-mean":
        return int(mask.sum())
    if seq_ids is None:
        raise ValueError(f"aggregation={mode!r} needs seq_ids [T]")
    return int(torch.unique(seq_ids[mask.bool()]).numel())


def aggregate(loss_T: torch.Tensor, inputs: LossInputs, mode: str, *,
              norm_constant: float | None = None) -> torch.Tensor:
    """This call's share of the aggregated loss (plain-autograd form).

    Args:
        loss_T: [T] per-token loss.
        inputs: the call's ``mask`` ([T] bool/float valid tokens), ``seq_ids`` ([T] response index,
            seq-mean-token-mean), ``num_tokens_global`` (N, valid tokens of the whole mini-batch:
            all micro-batches, DP×CP) and ``num_seqs_global`` (S, responses of the whole
            mini-batch, seq-mean-* modes); the other fields are not read.
        mode: 'token-mean' Σmℓ/N; 'seq-mean-token-mean' Σ_i (1/|o_i|)Σ_t mℓ / S;
            'seq-mean-token-sum' Σmℓ / S; 'seq-mean-token-sum-norm' Σmℓ / C (Dr.GRPO).
        norm_constant: C (seq-mean-token-sum-norm).

    Returns:
        0-d tensor; summed over micro-batches and DP ranks it equals the mini-batch loss. With DP
        gradients *averaged* (not summed), multiply by the DP size.
    """
    mask, seq_ids = inputs.mask, inputs.seq_ids
    num_tokens_global, num_seqs_global = inputs.num_tokens_global, inputs.num_seqs_global
    m = mask.to(loss_T.dtype)
    if mode == "token-mean":
        return (loss_T * m).sum() / num_tokens_global
    if mode == "seq-mean-token-sum-norm":
        if not norm_constant:
            raise ValueError("aggregation='seq-mean-token-sum-norm' needs norm_constant (C)")
        return (loss_T * m).sum() / norm_constant
    if num_seqs_global is None or not num_seqs_global > 0:
        raise ValueError(f"aggregation={mode!r} needs num_seqs_global > 0, got {num_seqs_global}")
    if mode == "seq-mean-token-sum":
        return (loss_T * m).sum() / num_seqs_global
    if mode == "seq-mean-token-mean":
        if seq_ids is None:
            raise ValueError("aggregation='seq-mean-token-mean' needs seq_ids [T]")
        lens = seq_token_counts(mask, seq_ids).to(loss_T.dtype).clamp_min(1.0)
        return (loss_T * m / lens).sum() / num_seqs_global
    raise ValueError(f"aggregation={mode!r}; accepted: token-mean, seq-mean-token-mean, "
                     "seq-mean-token-sum, seq-mean-token-sum-norm")


def megatron_loss_tuple(loss: torch.Tensor, *, num_local_units: int, num_global_units: float,
                        report: dict[str, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Repackage ``aggregate``'s output for Megatron's ``calculate_per_token_loss=True`` path.

    The schedule does not divide, DDP sums gradients and ``finalize_model_grads`` divides them by the
    DP-summed second element. Returning ``(loss·N_glob, n_local)`` makes that division exact: the
    n_local of all micro-batches and DP ranks sum to N_glob. (For seq-mean-token-sum-norm use token
    units: the division by N_glob cancels the ×N_glob, leaving Σmℓ/C.)

    Args:
        loss: 0-d output of ``aggregate`` for this micro-batch.
        num_local_units: ``local_units(...)`` of this micro-batch (with CP: on one CP rank only).
        num_global_units: the N (or S) ``aggregate`` divided by.
        report: detached metrics to pass through.

    Returns:
        (numerator 0-d, count 0-d int tensor, report).
    """
    count = torch.tensor(num_local_units, dtype=torch.int64, device=loss.device)
    return loss * num_global_units, count, dict(report or {})

"""Vocab-parallel token log-probs, exact entropy and logsumexp in one pass over the vocab slice.

Layout: each rank of the tensor-parallel group ``tp_group`` holds a contiguous slice of the
(padded) vocabulary, rank ``r`` owning global ids ``[r·V/tp, (r+1)·V/tp)`` exactly as Megatron's
``VocabParallelEmbedding`` / output layer lay it out. Rows ``>= vocab_size`` (the padding Megatron
adds so the vocabulary divides by ``make_vocab_size_divisible_by · tp``) never enter the softmax and
receive zero gradient.

Cost model (see docs/logprobs.md):

* forward: one sweep per token chunk, fp32 upcast per row block only; two collectives per call (MAX of
  ``[T]``, SUM of ``[3, T]`` fp32 = 16 B/token/rank), independent of the number of chunks;
* backward: the softmax is recomputed per chunk from the saved input (nothing ``[T, V/tp]`` is
  saved beyond the input itself) and needs **no** collective;
* extra memory: O(T) statistics plus two fp32 row-block temporaries sized from a byte budget
  (``logprobs_budget``), plus the gradient.

Entry points: :func:`vocab_parallel_logprobs` (logits given) and
:func:`vocab_parallel_logprobs_from_hidden` (fused LM head, in ``logprobs_hidden``).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron_maspo.parallel.logprobs_budget import ChunkPlan, plan_chunks
from megatron_maspo.parallel.logprobs_core import (
    SWEEPS,
    SweepCounter,
    acc_dtype,
    check_inputs,
    chunk_grad,
    chunk_stats,
    combine_stats,
    count_sweeps,
    local_labels,
    workspace,
)
from megatron_maspo.parallel.logprobs_hidden import vocab_parallel_logprobs_from_hidden

logger = logging.getLogger(__name__)

__all__ = ["SWEEPS", "SweepCounter", "count_sweeps", "vocab_parallel_logprobs",
           "vocab_parallel_logprobs_from_hidden", "check_inputs"]


class _VocabParallelLogprobs(torch.autograd.Function):
    """Autograd function over ``[T, V/tp]`` logits; see the module docstring for the maths."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup | None,
                temperature: float, plan: ChunkPlan, vocab_start: int, num_valid: int,
                ignore_index: int, return_lse: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens = logits.shape[0]
        idx, keep = local_labels(labels, vocab_start, num_valid, ignore_index)
        stats = [logits.new_empty(num_tokens, dtype=acc_dtype(logits.dtype)) for _ in range(4)]
        bufs = workspace(plan.block, num_valid, logits.device, acc_dtype(logits.dtype))
        for c0 in range(0, num_tokens, plan.chunk):
            c1 = min(c0 + plan.chunk, num_tokens)
            out = chunk_stats(logits[c0:c1, :num_valid], idx[c0:c1], temperature, bufs)
            for dst, src in zip(stats, out):
                dst[c0:c1] = src
        del bufs
        logprob, entropy, lse, mean_x = combine_stats(*stats, keep, group)
        ctx.save_for_backward(logits, idx, keep, lse, mean_x)
        # When lse is not handed to the caller its (materialised, zero) grad is skipped.
        ctx.cfg = (temperature, plan, num_valid, return_lse)
        return logprob, entropy, lse

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor, g_ent: torch.Tensor, g_lse: torch.Tensor):
        logits, idx, keep, lse, mean_x = ctx.saved_tensors
        temperature, plan, num_valid, return_lse = ctx.cfg
        # The log-prob of an ignored label is the constant 0: no gradient through it.
        g_lp = torch.where(keep, g_lp.to(lse.dtype), 0.0)
        g_ent = g_ent.to(lse.dtype)
        g_lse = g_lse.to(lse.dtype) if return_lse else None
        grad = torch.empty_like(logits)
        grad[:, num_valid:] = 0  # padded vocabulary rows never entered the softmax
        num_tokens = logits.shape[0] if num_valid else 0
        bufs = workspace(plan.block, num_valid, logits.device, lse.dtype) if num_tokens else None
        for c0 in range(0, num_tokens, plan.chunk):
            sl = slice(c0, min(c0 + plan.chunk, num_tokens))
            chunk_grad(logits[sl, :num_valid], idx[sl], lse[sl], mean_x[sl], g_lp[sl], g_ent[sl],
                       None if g_lse is None else g_lse[sl], temperature,
                       out=grad[sl, :num_valid], bufs=bufs)
        return grad, None, None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    chunk_bytes: int | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    return_lse: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Log-prob of each label and exact entropy of ``softmax(logits / temperature)``.

    Args:
        logits: [T, V/tp] fp32 or bf16, vocab-sharded over ``group`` (contiguous slices, padded rows
            included); never upcast as a whole and never modified.
        labels: [T] integer global vocabulary ids, identical on every rank of ``group``.
        group: the tensor-parallel group the vocabulary is split over; None = a single rank (no
            collectives). Megatron's global ``parallel_state`` is never consulted.
        temperature: τ > 0; outputs are those of ``softmax(logits / τ)`` and gradients include 1/τ.
        chunk_size: tokens per chunk; overrides ``chunk_bytes`` (tests, benchmarks).
        chunk_bytes: workspace budget in bytes (two fp32 row-block temporaries, see
            :func:`~megatron_maspo.parallel.logprobs_budget.plan_chunks`); None = the device
            default (256 MiB on GPU, 64 MiB on CPU).
        vocab_size: the true vocabulary size; global ids ``>= vocab_size`` (padding) are masked.
            None = ``V/tp · tp`` (no padding).
        ignore_index: labels equal to it give log-prob 0 and no log-prob gradient; their entropy
            (and lse) are still the valid values of the full distribution (mask them in the loss).
        return_lse: also return the logsumexp of ``logits / τ``.

    Returns:
        ``(logprobs, entropy)`` or ``(logprobs, entropy, lse)``, each [T] fp32 (fp64 for fp64
        logits: the reduction dtype), replicated over ``group``; all differentiable w.r.t.
        ``logits`` (backward needs no collective).

    Raises:
        TypeError, ValueError: see :func:`check_inputs`; also for a non-2-D or non-float ``logits``.
    """
    if not logits.dtype.is_floating_point or logits.dim() != 2:
        raise TypeError(f"logits must be a 2-D float tensor [T, V/tp], got {logits.dtype} "
                        f"{tuple(logits.shape)}")
    num_tokens, vocab_local = logits.shape
    _, start, num_valid = check_inputs(labels, num_tokens, vocab_local, group, temperature,
                                       vocab_size, ignore_index)
    plan = plan_chunks(num_tokens, num_valid, logits.element_size(), logits.device, tile=False,
                       budget_bytes=chunk_bytes, chunk_size=chunk_size)
    logprob, entropy, lse = _VocabParallelLogprobs.apply(
        logits, labels, group, float(temperature), plan, start, num_valid, ignore_index,
        return_lse)
    return (logprob, entropy, lse) if return_lse else (logprob, entropy)


"""Gather the response rows of sequence-parallel hidden states, and nothing else.

With Megatron sequence parallelism (TE spec, TP > 1) the last stage's final-norm hidden states are
split along the sequence: TP rank ``r`` holds rows ``[r*S/tp, (r+1)*S/tp)`` of the packed row.
The log-prob pass needs only the ``T`` response rows, replicated over TP
(``vocab_parallel_logprobs_from_hidden``). Gathering the whole ``[S, H]`` (what Megatron's output
layer does) would move every prompt row too; :func:`gather_rows_sequence_parallel` moves each
rank's response rows once (one all-gather of ``[max_r T_r, H]`` blocks).

Backward needs no collective: ``vocab_parallel_logprobs_from_hidden`` already all-reduces the
hidden gradient over TP, so every rank holds the full ``[T, H]`` gradient and keeps its own rows.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_maspo.parallel import comm


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, rows: torch.Tensor, group: Any) -> torch.Tensor:
        tp, rank, n = group.size(), group.rank(), local.shape[0]
        owner = torch.div(rows, n, rounding_mode="floor")
        if rows.numel() and (int(owner.min()) < 0 or int(owner.max()) >= tp):
            raise ValueError(f"row index out of range for {tp} ranks x {n} local rows")
        order = torch.argsort(owner, stable=True)  # rank-major, original order within a rank
        counts = torch.bincount(owner, minlength=tp).tolist()
        start = sum(counts[:rank])
        mine = rows[order[start:start + counts[rank]]] - rank * n
        width = max(counts + [1])
        block = local.new_zeros(width, local.shape[1])
        block[:counts[rank]] = local.index_select(0, mine)
        parts = comm.all_gather(block, group=group)
        out = torch.empty(rows.numel(), local.shape[1], dtype=local.dtype, device=local.device)
        out[order] = torch.cat([p[:c] for p, c in zip(parts, counts)])
        ctx.save_for_backward(order, mine)
        ctx.span, ctx.n = (start, start + counts[rank]), n
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        order, mine = ctx.saved_tensors
        a, b = ctx.span
        d_local = grad.new_zeros(ctx.n, grad.shape[1])
        d_local.index_add_(0, mine, grad[order[a:b]])
        return d_local, None, None


def gather_rows_sequence_parallel(local: torch.Tensor, rows: torch.Tensor, group: Any) -> torch.Tensor:
    """Rows ``rows`` of a sequence-parallel ``[S, H]`` tensor, replicated over ``group``.

    Args:
        local: ``[S/tp, H]`` this rank's contiguous slice of the sequence (rank order).
        rows: ``[T]`` int64 global row indices in ``[0, S)`` (any order), identical on all ranks.
        group: the tensor-parallel group the sequence is split over.

    Returns:
        ``[T, H]`` with ``out[i] = full[rows[i]]`` on every rank; its gradient must be the same on
        every rank (true downstream of ``vocab_parallel_logprobs_from_hidden``), and flows back
        to ``local`` without communication.
    """
    if local.dim() != 2 or rows.dim() != 1:
        raise ValueError(f"local must be [S/tp, H] and rows [T]; got {tuple(local.shape)}, "
                         f"{tuple(rows.shape)}")
    if group is None or group.size() == 1:
        return local.index_select(0, rows)
    return _GatherRows.apply(local, rows, group)

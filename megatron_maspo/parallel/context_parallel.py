"""Context parallelism (CP) for packed rows: the load-balanced split and the K/V all-gather.

Layout (Megatron's, so Transformer Engine's CP attention and Megatron's thd rotary read it as is):
each packed sequence, padded to a multiple of ``2·cp`` tokens, is cut into ``2·cp`` equal chunks and
CP rank ``r`` holds chunks ``r`` and ``2·cp-1-r`` (a head and a tail chunk). Under causal attention
chunk ``j`` costs ``∝ j + 1``, so every rank does the same work. Rank ``r``'s local row is the
concatenation, sequence by sequence, of its two chunks; ``cu_seqlens`` stay the *global* (padded)
bounds, and a sequence with global bounds ``[a, b)`` occupies local rows ``[a/cp, b/cp)``.

The index maths are pure functions of host ints (every rank computes every rank's split, so the
trainer can put a CP-split value back together without asking anyone). :func:`gather_cp` is the
autograd all-gather of the attention: forward an all-gather over the CP group, backward a
reduce-scatter of the gradient (each rank's K/V received gradient from every rank's queries).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_maspo.parallel import comm


def cp_padded_length(n: int, cp: int) -> int:
    """``n`` rounded up to a multiple of ``2·cp`` (Megatron's per-sequence CP padding)."""
    if n < 0 or cp < 1:
        raise ValueError(f"need n >= 0 and cp >= 1, got n={n}, cp={cp}")
    m = 2 * cp
    return -(-n // m) * m


def check_cp_bounds(bounds: Sequence[int], cp: int) -> None:
    """Raise ``ValueError`` unless every sequence of the global ``bounds`` divides by ``2·cp``."""
    for a, b in zip(bounds[:-1], bounds[1:]):
        if (b - a) % (2 * cp):
            raise ValueError(f"packed sequence [{a}, {b}) of length {b - a} is not a multiple of "
                             f"2*cp = {2 * cp}: pad each sequence (parallel.context_parallel)")


def cp_local_positions(bounds: Sequence[int], cp: int, cp_rank: int) -> torch.Tensor:
    """Global row positions held by CP rank ``cp_rank``, in its local order.

    Args:
        bounds: global padded ``cu_seqlens`` ``[n+1]`` (each length a multiple of ``2·cp``).

    Returns:
        ``[S/cp]`` int64: local row ``i`` holds global row position ``out[i]``.
    """
    check_cp_bounds(bounds, cp)
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} out of range for cp={cp}")
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        c = (b - a) // (2 * cp)
        for j in (cp_rank, 2 * cp - 1 - cp_rank):
            parts.append(torch.arange(a + j * c, a + (j + 1) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def cp_gather_order(bounds: Sequence[int], cp: int) -> torch.Tensor:
    """Permutation that puts the rank-ordered concatenation of local rows back in global order.

    ``full = torch.cat([local_0, ..., local_{cp-1}]).index_select(0, order)`` restores the row.

    Returns:
        ``[S]`` int64.
    """
    held = torch.cat([cp_local_positions(bounds, cp, r) for r in range(cp)])  # [S]: global pos
    order = torch.empty_like(held)
    order[held] = torch.arange(held.numel())
    return order


def cp_owner(positions: torch.Tensor, bounds: Sequence[int], cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which CP rank holds each global row position, and at which local row.

    Args:
        positions: ``[T]`` int64 global row positions.
        bounds: global padded ``cu_seqlens``.

    Returns:
        ``(rank [T], local_row [T])`` int64.
    """
    check_cp_bounds(bounds, cp)
    b = torch.tensor(list(bounds), dtype=torch.long)
    seq = torch.searchsorted(b, positions, right=True) - 1  # [T] sequence of each position
    start, length = b[seq], b[seq + 1] - b[seq]
    c = length // (2 * cp)
    off = positions - start
    chunk = off // c
    head = chunk < cp  # chunk j < cp sits on rank j (first half of its local piece)
    rank = torch.where(head, chunk, 2 * cp - 1 - chunk)
    local = start // cp + torch.where(head, off - chunk * c, c + off - chunk * c)
    return rank, local


def local_bounds(bounds: Sequence[int], cp: int) -> list[int]:
    """Local ``cu_seqlens`` of every CP rank (each global bound ÷ cp)."""
    check_cp_bounds(bounds, cp)
    return [x // cp for x in bounds]


class _GatherCP(torch.autograd.Function):
    """``[n, ...]`` per rank → ``[cp·n, ...]`` (rank order); backward: reduce-scatter of the grad."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return torch.cat(comm.all_gather(x.contiguous(), group=group), dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.reduce_scatter(grad.contiguous(), group=ctx.group), None


def gather_cp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Autograd all-gather of ``x`` ``[n, ...]`` over the CP ``group`` → ``[cp·n, ...]``, rank order."""
    return _GatherCP.apply(x, group)

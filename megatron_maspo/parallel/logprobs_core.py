"""Chunk maths shared by the vocab-parallel log-prob paths (logits given, or from hidden states).

Notation (per token): ``z`` raw logits over the full vocabulary ``V``, ``x = z / τ`` the
temperature-scaled logits, ``lse = log Σ_j exp(x_j)``, ``p = exp(x - lse)``. Outputs are

* ``log p_y = x_y - lse``,
* ``H = lse - Σ_j p_j x_j`` (exact entropy of the full distribution),

and the gradient of ``L = g_lp · log p_y + g_H · H + g_lse · lse`` w.r.t. ``x_j`` is

    ∂L/∂x_j = g_lp (δ_jy - p_j) - g_H p_j (x_j - E_p[x]) + g_lse p_j,

so backward needs only the per-token scalars ``lse`` and ``E_p[x] = lse - H``: no collective.

One sweep per chunk: each TP rank reduces its chunk ``[C, n_valid]`` to four per-token fp32 scalars
with a *local* max ``m_l`` (max, ``s_l = Σ e^(x-m_l)``, ``u_l = Σ e^(x-m_l)(x-m_l)``, label logit);
the ranks are merged afterwards, online-softmax style, with one MAX all-reduce of ``[T]`` and one
SUM all-reduce of ``[3, T]`` (16 B per token in total). Keeping ``u`` relative to the max makes
``H = log S - U/S`` a sum of two non-negative terms, so low-entropy tokens with large logits do not
suffer the cancellation of ``lse - Σ p x``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_maspo.parallel import comm

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class SweepCounter:
    """Counts full-vocabulary sweeps over a chunk (one per chunk each way is the design).

    A sweep is one read of a ``[C, V/tp]`` chunk that yields all the statistics it has to
    produce (forward: max, Σexp, Σp·x, label logit; backward: the gradient).
    """

    enabled: bool = False
    forward: int = 0
    backward: int = 0


SWEEPS = SweepCounter()
"""Module-level counter; only touched while ``SWEEPS.enabled`` (see :func:`count_sweeps`)."""


@contextmanager
def count_sweeps() -> Iterator[SweepCounter]:
    """Reset :data:`SWEEPS`, enable counting inside the block, and yield it."""
    SWEEPS.forward = SWEEPS.backward = 0
    SWEEPS.enabled = True
    try:
        yield SWEEPS
    finally:
        SWEEPS.enabled = False


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reduction dtype: fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 (used by gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of ``group``; ``None`` means a single rank without collectives."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_inputs(labels: torch.Tensor, num_tokens: int, vocab_local: int,
                 group: dist.ProcessGroup | None, temperature: float, vocab_size: int | None,
                 ignore_index: int) -> tuple[int, int, int]:
    """Validate shared arguments; return ``(vocab_size, vocab_start, num_valid_local)``.

    Raises:
        TypeError: ``labels`` is not an integer tensor.
        ValueError: bad shapes, temperature, vocab_size, or a label outside ``[0, vocab_size)`` that
            is not ``ignore_index`` (checked on the host: one device sync per call, which is cheaper
            than a silently wrong log-prob).
    """
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if labels.dim() != 1 or labels.shape[0] != num_tokens:
        raise ValueError(f"labels must be [T={num_tokens}], got {tuple(labels.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rank, tp = group_rank_size(group)
    padded = vocab_local * tp
    vocab_size = padded if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size must be in (0, {padded}] (local slice {vocab_local} x tp "
                         f"{tp}), "
                         f"got {vocab_size}")
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if num_tokens and bool(bad.any()):
        raise ValueError(f"labels must be in [0, vocab_size={vocab_size}) or ignore_index="
                         f"{ignore_index}; got e.g. {labels[bad][:4].tolist()}")
    start = rank * vocab_local
    return vocab_size, start, max(0, min(vocab_local, vocab_size - start))


def local_labels(labels: torch.Tensor, vocab_start: int, num_valid: int,
                 ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Map global label ids to this rank's slice.

    Returns:
        ``(idx, keep)``: ``idx`` [T] int64, the local column of the label or -1 when the label lives
        on another rank or is ignored; ``keep`` [T] bool, False for ``ignore_index`` labels.
    """
    keep = labels != ignore_index
    local = labels.long() - vocab_start
    mine = keep & (local >= 0) & (local < num_valid)
    return torch.where(mine, local, -1), keep


def workspace(block: int, n: int, device: torch.device, dtype: torch.dtype = torch.float32
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two reusable fp32 (fp64 for fp64 inputs) row-block temporaries, each ``[block, n]``.

    Allocated once per forward/backward and reused by every block: no allocator traffic (or, on
    CPU, fresh page faults) per chunk.
    """
    return (torch.empty(block, n, device=device, dtype=dtype),
            torch.empty(block, n, device=device, dtype=dtype))


def chunk_stats(z: torch.Tensor, idx: torch.Tensor, temperature: float,
                bufs: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sweep over a chunk of local, valid logits, in row blocks of ``bufs``' height.

    Per row block, four elementwise passes with no allocation: ``a = (z - m)/τ`` (the upcast
    copy), ``b = exp(a)``, ``Σ b``, ``Σ b·a`` (in place). ``z`` itself is never modified.

    Args:
        z: [C, n] any float dtype, this rank's valid (non-padded) vocabulary columns.
        idx: [C] int64, local label column or -1 (label elsewhere / ignored).
        temperature: τ; statistics are of ``x = z / τ``.
        bufs: two ``[R, n]`` temporaries in the reduction dtype (:func:`workspace`); None =
            one block of ``C`` rows.

    Returns:
        ``(m, s, u, t)``, each [C] fp32: local max of x, ``Σ e^(x-m)``, ``Σ e^(x-m)(x-m)`` (≤ 0),
        and ``x_label`` (0 where ``idx`` is -1).
    """
    rows, n = z.shape
    acc = acc_dtype(z.dtype)
    if n == 0:  # a rank holding only padded rows
        zero = z.new_zeros(rows, dtype=acc)
        return torch.full_like(zero, float("-inf")), zero, zero.clone(), zero.clone()
    if SWEEPS.enabled:
        SWEEPS.forward += 1
    if bufs is None:
        bufs = workspace(rows, n, z.device, acc)
    inv = 1.0 / temperature
    has = idx >= 0
    t = z.gather(1, idx.clamp(min=0).unsqueeze(1)).squeeze(1).to(acc).mul_(inv).masked_fill_(~has, 0.0)
    m, s, u = (torch.empty_like(t) for _ in range(3))
    step = bufs[0].shape[0]
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        a, b = bufs[0][: r1 - r0], bufs[1][: r1 - r0]
        m[r0:r1] = z[r0:r1].amax(dim=1)  # exact in any float dtype; the rows are now in cache
        torch.sub(z[r0:r1], m[r0:r1].unsqueeze(1), out=a)  # upcast + shift in one pass
        if temperature != 1.0:
            a.mul_(inv)
        torch.exp(a, out=b)
        torch.sum(b, dim=1, out=s[r0:r1])
        torch.sum(b.mul_(a), dim=1, out=u[r0:r1])
    return m.mul_(inv), s, u, t


def combine_stats(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, t: torch.Tensor,
                  keep: torch.Tensor, group: dist.ProcessGroup | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge per-rank statistics into global log-prob, entropy, lse and E_p[x].

    Two collectives for the whole call (not per chunk): MAX over ``m`` [T] fp32 and one fused SUM
    over ``[3, T]`` fp32, i.e. 16 bytes per token per rank.

    Args:
        m, s, u, t: [T] fp32 from :func:`chunk_stats` over all chunks of this rank.
        keep: [T] bool, False where the label is ``ignore_index``.
        group: the tensor-parallel group the vocabulary is split over (None: single rank).

    Returns:
        ``(logprob, entropy, lse, mean_x)``, each [T] fp32; ``logprob`` is 0 where ``keep`` is
        False, the others stay valid there.
    """
    big_m = m.clone()
    if group is not None:
        comm.all_reduce(big_m, op=comm.ReduceOp.MAX, group=group)
    d = m - big_m  # ≤ 0; -inf on a rank without valid columns
    a = torch.exp(d)
    buf = torch.stack([a * s, torch.where(s > 0, a * (u + d * s), 0.0), t])
    if group is not None:
        comm.all_reduce(buf, op=comm.ReduceOp.SUM, group=group)
    big_s, big_u, x_label = buf.unbind(0)
    log_s = torch.log(big_s)
    lse = big_m + log_s
    mean_rel = big_u / big_s  # E_p[x - M] ≤ 0
    entropy = log_s - mean_rel
    logprob = torch.where(keep, x_label - lse, 0.0)
    return logprob, entropy, lse, big_m + mean_rel


def chunk_grad(z: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor, mean_x: torch.Tensor,
               g_lp: torch.Tensor, g_ent: torch.Tensor, g_lse: torch.Tensor | None,
               temperature: float, out: torch.Tensor,
               bufs: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Recompute one chunk's softmax and write ∂L/∂z into ``out`` (see the module docstring).

    With ``x = z/τ`` the gradient is ``∂L/∂z_j = p_j (k z_j + b) + δ_jy g_lp/τ`` where
    ``k = -g_H/τ²`` and ``b = (g_H E_p[x] - g_lp + g_lse)/τ`` are per-token scalars, so each row
    block takes three elementwise passes and no allocation: ``a = exp(x - lse)`` (the upcast copy),
    ``b = k·z + b`` (one fused multiply-add), ``out = a·b``.

    Args:
        z: [C, n] this rank's valid logits for the chunk, any float dtype.
        idx: [C] int64 local label column or -1.
        lse, mean_x: [C] fp32 global statistics saved by the forward.
        g_lp: [C] fp32 upstream grad of log-prob, already zeroed for ignored labels.
        g_ent: [C] fp32 upstream grad of entropy; g_lse: [C] fp32 or None.
        temperature: τ.
        out: [C, n] where the gradient goes (any float dtype; may be ``z`` itself: each block reads
            its rows of ``z`` before writing them).
        bufs: two ``[R, n]`` temporaries in the reduction dtype; None = one block of ``C`` rows.

    Returns:
        ``out``.
    """
    if SWEEPS.enabled:
        SWEEPS.backward += 1
    rows, n = z.shape
    if bufs is None:
        bufs = workspace(rows, n, z.device, acc_dtype(z.dtype))
    inv = 1.0 / temperature
    shift = (lse * temperature).unsqueeze(1)
    k = (g_ent * -(inv * inv)).unsqueeze(1)
    bias = g_ent * mean_x - g_lp
    if g_lse is not None:
        bias = bias + g_lse
    bias = bias.mul_(inv).unsqueeze(1)
    # Rows whose label is elsewhere add 0 at column 0: no host sync, no data-dependent shapes.
    add = torch.where(idx >= 0, g_lp * inv, 0.0).unsqueeze(1)
    col = idx.clamp(min=0).unsqueeze(1)
    step = bufs[0].shape[0]
    exact = out.dtype == bufs[0].dtype
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        a, b = bufs[0][: r1 - r0], bufs[1][: r1 - r0]
        torch.sub(z[r0:r1], shift[r0:r1], out=a)
        if temperature != 1.0:
            a.mul_(inv)
        a.exp_()  # p
        torch.addcmul(bias[r0:r1], z[r0:r1], k[r0:r1], out=b)
        if exact:
            torch.mul(a, b, out=out[r0:r1])
        else:  # bf16/fp16 out: add the label term in fp32, then round once
            out[r0:r1] = a.mul_(b).scatter_add_(1, col[r0:r1], add[r0:r1])
    if exact:
        out.scatter_add_(1, col, add)
    return out

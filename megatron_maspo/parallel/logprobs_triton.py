"""Triton kernels for the fused LM head + log-prob/entropy (``logprobs_hidden``): the logits never leave
on-chip memory in forward, and backward writes only one chunk's ``∂L/∂z`` at a time.

The only module that imports triton. ``logprobs_hidden`` chooses it (``kernel="auto"``: on CUDA when
triton imports; ``"triton"`` forces it, which on CPU needs ``TRITON_INTERPRET=1``); everything around
the kernels (label mapping, the TP combine, the fp32 weight-gradient accumulation, chunk budgets) is the
torch path's own code, so both paths share their maths outside the tile.

**Forward** (:func:`fused_stats`). Grid = (token tiles of ``BM``) x (vocabulary splits); token tiles
vary fastest, so the programs running together read the same weight tiles and L2 serves all but the
first read. A program streams its vocabulary range in ``BN``-column tiles, accumulates ``z = h Wᵀ`` over
``H`` in ``BK`` steps in fp32 (``tl.dot``), and folds each tile into running per-token statistics of
``x = z/τ`` exactly as ``logprobs_core.chunk_stats`` defines them (docs/logprobs.md)::

    m' = max(m, max_j x_j)          s' = e^(m-m') s + Σ_j e^(x_j-m')
    u' = e^(m-m') (u + (m-m') s) + Σ_j e^(x_j-m') (x_j-m')        t += x_y (the label's column)

It writes ``(m, s, u, t)``, 16 B per token per split; :func:`merge_splits` folds the splits into one
rank's statistics (the same merge ``combine_stats`` does over TP ranks), and ``combine_stats`` then
merges the ranks with its two collectives (16 B/token).

**Backward** (:func:`fused_dz`). Per token chunk (the torch path's byte budget), one kernel recomputes
the chunk's ``z`` tile by tile and writes ``∂L/∂z_j = p_j (k z_j + b) + δ_jy g_lp/τ`` (``p_j =
e^(x_j - lse)``; per-token ``k = -g_H/τ²``, ``b = (g_H E_p[x] - g_lp)/τ``, as ``chunk_grad``) in the
input dtype; cuBLAS then forms ``dh = dz W`` and ``dW += dzᵀ h`` (fp32 accumulation across chunks).
This is the recompute branch of the store-or-recompute rule: the forward keeps nothing of ``z``.

Inputs are fp32 or bf16/fp16 with fp32 accumulation. Under Triton's CPU interpreter ``tl.dot`` on
bf16 operands returns wrong values without an error, so loads are cast to fp32 there (``CAST``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BM, BN, BK = 64, 64, 32
"""Tile sizes: tokens, vocabulary columns, hidden. 64 x 64 fp32 accumulators fit registers at 4 warps."""


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # read by triton.jit below, at import


def interpreting() -> bool:
    """Whether this module's ``@triton.jit`` code runs in Triton's CPU interpreter: ``TRITON_INTERPRET=1``
    when it was imported (triton reads it as it decorates)."""
    return _INTERPRET


@triton.jit
def _dot_tile(h_ptr, w_ptr, rows, cols, rmask, cmask, H, stride_h, stride_w,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CAST: tl.constexpr):
    """``z[rows, cols] = h[rows] · w[cols]ᵀ`` in fp32 (masked rows/columns give 0)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < H
        a = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
        if CAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b)
    return acc


@triton.jit
def _stats_kernel(h_ptr, w_ptr, idx_ptr, out_ptr, T, V, H, per_split, stride_h, stride_w, inv_t,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CAST: tl.constexpr):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < T
    label = tl.load(idx_ptr + rows, mask=rmask, other=-1)
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_M,), dtype=tl.float32)
    u = tl.zeros((BLOCK_M,), dtype=tl.float32)
    t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, V)
    for v0 in range(lo, hi, BLOCK_N):
        cols = v0 + tl.arange(0, BLOCK_N)
        cmask = cols < hi
        x = _dot_tile(h_ptr, w_ptr, rows, cols, rmask, cmask, H, stride_h, stride_w,
                      BLOCK_M, BLOCK_N, BLOCK_K, CAST) * inv_t
        x = tl.where(cmask[None, :], x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1))  # finite: every tile has a valid column
        d = tl.where(s > 0, m - m_new, 0.0)  # first tile: s = u = 0 and m = -inf (no inf - inf)
        alpha = tl.exp(d)
        e = tl.exp(x - m_new[:, None])  # 0 on masked columns
        rel = tl.where(cmask[None, :], x - m_new[:, None], 0.0)
        u = alpha * (u + d * s) + tl.sum(e * rel, 1)
        s = alpha * s + tl.sum(e, 1)
        m = m_new
        t += tl.sum(tl.where(cols[None, :] == label[:, None], x, 0.0), 1)
    base = out_ptr + split * 4 * T + rows
    tl.store(base, m, mask=rmask)
    tl.store(base + T, s, mask=rmask)
    tl.store(base + 2 * T, u, mask=rmask)
    tl.store(base + 3 * T, t, mask=rmask)


@triton.jit
def _dz_kernel(h_ptr, w_ptr, idx_ptr, lse_ptr, k_ptr, b_ptr, add_ptr, dz_ptr, C, V, H,
               stride_h, stride_w, stride_dz, inv_t,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < C
    cmask = cols < V
    z = _dot_tile(h_ptr, w_ptr, rows, cols, rmask, cmask, H, stride_h, stride_w, BLOCK_M, BLOCK_N, BLOCK_K, CAST)
    label = tl.load(idx_ptr + rows, mask=rmask, other=-1)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    k = tl.load(k_ptr + rows, mask=rmask, other=0.0)
    b = tl.load(b_ptr + rows, mask=rmask, other=0.0)
    add = tl.load(add_ptr + rows, mask=rmask, other=0.0)
    p = tl.exp(z * inv_t - lse[:, None])
    g = p * (k[:, None] * z + b[:, None]) + tl.where(cols[None, :] == label[:, None], add[:, None], 0.0)
    mask = rmask[:, None] & cmask[None, :]
    tl.store(dz_ptr + rows[:, None] * stride_dz + cols[None, :], g.to(dz_ptr.dtype.element_ty), mask=mask)


def _splits(num_tokens: int, num_valid: int, device: torch.device) -> int:
    """Vocabulary splits: enough programs to fill the GPU twice over (each split costs 16 B/token)."""
    tiles_n = triton.cdiv(num_valid, BN)
    if device.type != "cuda":
        return min(2, tiles_n)  # the interpreter: exercise the merge, keep the run short
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles_n, triton.cdiv(2 * sms, triton.cdiv(num_tokens, BM))))


def fused_stats(hidden: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor, temperature: float,
                splits: int | None = None) -> torch.Tensor:
    """Per-split statistics of ``x = hidden @ weightᵀ / τ``: ``[splits, 4, T]`` fp32 ``(m, s, u, t)``.

    Args:
        hidden: [T, H] fp32/bf16/fp16, contiguous rows.
        weight: [n, H] the same dtype: this rank's valid vocabulary rows (padding excluded).
        idx: [T] int64 local label column or -1 (``logprobs_core.local_labels``).
        splits: vocabulary splits; None = :func:`_splits`.
    """
    num_tokens, h = hidden.shape
    n = weight.shape[0]
    splits = splits or _splits(num_tokens, n, hidden.device)
    per_split = triton.cdiv(triton.cdiv(n, splits), BN) * BN
    splits = triton.cdiv(n, per_split)  # no split left without a column
    out = torch.empty(splits, 4, num_tokens, dtype=torch.float32, device=hidden.device)
    grid = (triton.cdiv(num_tokens, BM), splits)
    _stats_kernel[grid](hidden, weight, idx, out, num_tokens, n, h, per_split, hidden.stride(0), weight.stride(0),
                        1.0 / temperature, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, CAST=interpreting())
    return out


def merge_splits(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold ``[splits, 4, T]`` statistics into one rank's ``(m, s, u, t)`` (each [T] fp32), the merge
    ``combine_stats`` applies across ranks."""
    m, s, u, t = stats.unbind(1)
    big_m = m.amax(0)
    d = m - big_m
    a = torch.exp(d)
    return big_m, (a * s).sum(0), torch.where(s > 0, a * (u + d * s), 0.0).sum(0), t.sum(0)


def fused_dz(hidden: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor,
             k: torch.Tensor, b: torch.Tensor, add: torch.Tensor, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """``out[c, j] = ∂L/∂z_cj`` for one chunk, the logits recomputed tile by tile (module docstring).

    Args:
        hidden: [C, H] the chunk's hidden states; weight: [n, H] valid rows.
        idx: [C] local label column or -1; lse: [C] global lse of ``x``; k, b, add: [C] fp32
            per-token scalars (``-g_H/τ²``, ``(g_H E_p[x] - g_lp)/τ``, ``g_lp/τ`` where the label is
            here, else 0).
        out: [C, n] written (the input dtype).
    """
    c, h = hidden.shape
    n = weight.shape[0]
    grid = (triton.cdiv(c, BM), triton.cdiv(n, BN))
    _dz_kernel[grid](hidden, weight, idx, lse, k, b, add, out, c, n, h, hidden.stride(0), weight.stride(0),
                     out.stride(0), 1.0 / temperature, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, CAST=interpreting())
    return out

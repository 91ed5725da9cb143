"""Fused LM head + vocab-parallel log-prob/entropy: from hidden states, never holding the logits.

The actor gathers hidden states at response positions only and calls
:func:`vocab_parallel_logprobs_from_hidden` with this rank's slice of the output-layer weight, so
prompt tokens are never projected onto the vocabulary and no ``[T, V/tp]`` tensor exists beyond
one chunk.

Per token chunk ``c`` (``C`` rows, ``C`` from the byte budget of ``logprobs_budget``; the short
remainder chunk first): forward computes ``z_c = h_c W^T`` into one reused ``[C, V/tp]`` tile (input
dtype, exactly what Megatron's output layer would produce) and reduces it in one sweep to four fp32
scalars per token; the ranks are merged with the same two collectives (16 B/token) as the logits
path. The tile is kept for backward: it still holds the last chunk's logits, so backward walks the
chunks in reverse, uses them as they are and recomputes ``z_c`` only for the others (one extra GEMM
per recomputed token: store-vs-recompute within the budget, docs/logprobs.md). It forms ``dz_c`` in
the tile and accumulates

* ``dW += dz_c^T h_c`` in fp32: in the gradient itself for fp32 weights, in an fp32 ``[V/tp, H]``
  buffer for bf16 (bf16 weights would lose bits summed chunk by chunk in bf16), and
* ``dh_c = dz_c W`` — a **partial** sum over this rank's vocabulary slice.

The true ``∂L/∂h`` sums over the whole vocabulary, so backward ends with one SUM all-reduce of
``dh`` [T, H] over the group: the only collective the maths requires, and the one Megatron's
``copy_to_tensor_model_parallel_region`` would perform in front of its output layer. Callers must
therefore pass the replicated (not sequence-parallel-scattered) hidden states and must not wrap
them in ``copy_to_tensor_model_parallel_region`` themselves, or the reduction happens twice.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron_maspo.parallel import comm
from megatron_maspo.parallel.logprobs_budget import ChunkPlan, chunk_bounds, plan_chunks
from megatron_maspo.parallel.logprobs_core import (
    acc_dtype,
    check_inputs,
    chunk_grad,
    chunk_stats,
    combine_stats,
    local_labels,
    workspace,
)

logger = logging.getLogger(__name__)

KERNELS = ("auto", "torch", "triton")
"""``train.logprob_kernel``: ``auto`` = the Triton kernels (``logprobs_triton``) on CUDA when triton
imports, the torch chunk loop everywhere else; ``torch`` / ``triton`` force one."""


def use_triton(kernel: str, hidden: torch.Tensor) -> bool:
    """Whether ``kernel`` runs the Triton kernels for ``hidden``.

    Raises:
        ValueError: an unknown kernel, or ``triton`` forced for fp64 (the kernels accumulate in fp32).
        ImportError: ``triton`` forced where triton does not import (one line with the fix).
    """
    if kernel not in KERNELS:
        raise ValueError(f"logprob kernel {kernel!r}; accepted: {', '.join(KERNELS)}")
    if kernel == "torch" or (kernel == "auto" and (hidden.device.type != "cuda" or hidden.dtype == torch.float64)):
        return False
    if hidden.dtype == torch.float64:
        raise ValueError("logprob kernel 'triton' accumulates in fp32: use 'torch' (or 'auto') for fp64 inputs")
    try:
        import triton  # noqa: F401
    except ImportError as e:
        if kernel == "auto":
            return False
        raise ImportError("train.logprob_kernel='triton' needs triton (pip install triton; on a CPU, run with "
                          "TRITON_INTERPRET=1)") from e
    if hidden.device.type != "cuda":
        from megatron_maspo.parallel.logprobs_triton import interpreting

        if not interpreting():
            raise ValueError("train.logprob_kernel='triton' on a CPU tensor needs TRITON_INTERPRET=1 (Triton's "
                             "interpreter; slow: tests only)")
    return True


class _VocabParallelLogprobsFromHidden(torch.autograd.Function):
    """Autograd function over ``(hidden [T, H], weight [V/tp, H])``; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                group: dist.ProcessGroup | None, temperature: float, plan: ChunkPlan,
                vocab_start: int, num_valid: int, ignore_index: int, triton: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = hidden.shape[0]
        acc = acc_dtype(hidden.dtype)
        idx, keep = local_labels(labels, vocab_start, num_valid, ignore_index)
        w = weight[:num_valid]  # padded rows are never multiplied
        bounds = chunk_bounds(num_tokens, plan.chunk)
        triton = triton and num_valid > 0 and num_tokens > 0
        tile = None
        if triton:  # one kernel over every token: no logits tile, 16 B per token and split
            from megatron_maspo.parallel import logprobs_triton

            stats = logprobs_triton.merge_splits(logprobs_triton.fused_stats(hidden, w, idx, temperature))
        else:
            stats = [hidden.new_empty(num_tokens, dtype=acc) for _ in range(4)]
            tile = hidden.new_empty(min(plan.chunk, num_tokens), num_valid)
            bufs = workspace(plan.block, num_valid, hidden.device, acc)
            for c0, c1 in bounds:
                z = tile[: c1 - c0]
                torch.mm(hidden[c0:c1], w.t(), out=z)
                for dst, src in zip(stats, chunk_stats(z, idx[c0:c1], temperature, bufs)):
                    dst[c0:c1] = src
            del bufs
        logprob, entropy, _, mean_x = combine_stats(*stats, keep, group)
        lse = mean_x + entropy  # E_p[x] + H; recomputed rather than saved twice
        ctx.save_for_backward(hidden, weight, idx, keep, lse, mean_x)
        ctx.cfg = (group, temperature, plan, num_valid, bounds, triton)
        # Store instead of recompute for the last chunk: the tile (<= the budget) still holds its
        # logits (the sweeps above never write it), so backward starts there without its GEMM. One
        # chunk per call (T <= C) means no recompute at all. (The Triton forward keeps no tile.)
        ctx.tile = tile if tile is not None and bounds and any(ctx.needs_input_grad[:2]) else None
        return logprob, entropy

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor, g_ent: torch.Tensor):
        hidden, weight, idx, keep, lse, mean_x = ctx.saved_tensors
        group, temperature, plan, num_valid, bounds, triton = ctx.cfg
        tile, ctx.tile = ctx.tile, None  # consumed in place: a second backward recomputes
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_lp = torch.where(keep, g_lp.to(lse.dtype), 0.0)
        g_ent = g_ent.to(lse.dtype)
        w = weight[:num_valid]
        num_tokens = hidden.shape[0] if num_valid else 0
        d_hidden = (torch.empty_like(hidden) if num_tokens else torch.zeros_like(hidden)
                    ) if need_h else None
        d_weight = torch.zeros_like(weight) if need_w else None
        # fp32 accumulation across chunks: into the gradient itself for fp32/fp64 weights, into a
        # separate fp32 buffer for bf16 (bf16 sums chunk by chunk would lose bits).
        d_w = None
        if need_w:
            d_w = d_weight[:num_valid] if weight.dtype == lse.dtype else w.new_zeros(
                w.shape, dtype=lse.dtype)
        kept = tile is not None
        if not kept and num_tokens:
            tile = hidden.new_empty(min(plan.chunk, num_tokens), num_valid)
        bufs = workspace(plan.block, num_valid, hidden.device, lse.dtype) if num_tokens and not triton else None
        if triton:
            from megatron_maspo.parallel import logprobs_triton
            inv = 1.0 / temperature
            k_all = g_ent * -(inv * inv)
            b_all = (g_ent * mean_x - g_lp) * inv
            add_all = torch.where(idx >= 0, g_lp * inv, 0.0)
        for k, (c0, c1) in enumerate(reversed(bounds) if num_tokens else ()):
            sl = slice(c0, c1)
            h, dz = hidden[sl], tile[: c1 - c0]
            if triton:  # z recomputed tile by tile and dz formed in the same kernel
                logprobs_triton.fused_dz(h, w, idx[sl], lse[sl], k_all[sl], b_all[sl], add_all[sl], temperature,
                                         out=dz)
            else:
                if k or not kept:  # recompute z = h W^T (the forward's tile holds only the last chunk)
                    torch.mm(h, w.t(), out=dz)
                chunk_grad(dz, idx[sl], lse[sl], mean_x[sl], g_lp[sl], g_ent[sl], None, temperature,
                           out=dz, bufs=bufs)
            if need_h:
                torch.mm(dz, w, out=d_hidden[sl])
            if need_w:
                if dz.dtype == d_w.dtype:
                    d_w.addmm_(dz.t(), h)
                else:
                    d_w.add_(dz.t() @ h)
        del tile, bufs
        if need_h and group is not None:
            comm.all_reduce(d_hidden, op=comm.ReduceOp.SUM, group=group)
        if need_w and d_w.data_ptr() != d_weight.data_ptr():
            d_weight[:num_valid] = d_w
        return d_hidden, d_weight, None, None, None, None, None, None, None, None


def vocab_parallel_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    chunk_bytes: int | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and exact entropy of ``softmax(hidden @ weight_full^T / τ)`` without the logits.

    Args:
        hidden: [T, H] fp32 or bf16, replicated over ``group`` (response positions only).
        weight: [V/tp, H] same dtype, this rank's contiguous slice of the output-layer weight
            (padded rows included).
        labels: [T] integer global vocabulary ids, identical on every rank.
        group: tensor-parallel group the vocabulary is split over; None = single rank.
        temperature: τ > 0.
        chunk_size: tokens per chunk; overrides ``chunk_bytes`` (tests, benchmarks).
        chunk_bytes: workspace budget in bytes: the ``[C, V/tp]`` logits tile plus two fp32
            row-block temporaries (:func:`~megatron_maspo.parallel.logprobs_budget.plan_chunks`);
            None = the device default (256 MiB on GPU, 64 MiB on CPU).
        vocab_size: true vocabulary size (rows ``>= vocab_size`` are padding); None = no padding.
        ignore_index: labels equal to it give log-prob 0 (entropy stays valid).
        kernel: ``train.logprob_kernel`` (:data:`KERNELS`, :func:`use_triton`).

    Returns:
        ``(logprobs, entropy)``, each [T] fp32 (fp64 for fp64 inputs), replicated over
        ``group``; differentiable w.r.t. ``hidden`` (gradient all-reduced over ``group`` in
        backward) and ``weight`` (local slice; padded rows get 0).

    Raises:
        TypeError, ValueError: mismatched shapes/dtypes or bad labels, temperature, vocab_size.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [T, H] and weight [V/tp, H]; got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if not hidden.dtype.is_floating_point or hidden.dtype != weight.dtype:
        raise TypeError(f"hidden and weight must share one float dtype, got {hidden.dtype} and "
                        f"{weight.dtype}")
    num_tokens, vocab_local = hidden.shape[0], weight.shape[0]
    _, start, num_valid = check_inputs(labels, num_tokens, vocab_local, group, temperature,
                                       vocab_size, ignore_index)
    plan = plan_chunks(num_tokens, num_valid, hidden.element_size(), hidden.device, tile=True,
                       budget_bytes=chunk_bytes, chunk_size=chunk_size)
    fused = use_triton(kernel, hidden)
    if fused:
        hidden = hidden.contiguous()  # the kernels read rows of unit stride
        weight = weight.contiguous()
    return _VocabParallelLogprobsFromHidden.apply(hidden, weight, labels, group, float(temperature),
                                                  plan, start, num_valid, ignore_index, fused)

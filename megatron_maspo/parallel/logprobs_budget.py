"""How many tokens a log-prob chunk holds: chosen from a memory budget in bytes, not a token count.

The working set of one chunk of ``C`` tokens over a vocabulary slice of ``n = V/tp`` columns is

* the chunk's logits tile ``[C, n]`` in the input dtype (``e`` bytes), from-hidden path only (the
  logits path reads the caller's logits in place), and
* two fp32 temporaries ``[R, n]`` per row block of ``R`` rows (shifted logits and their
  exponentials in forward; softmax and gradient coefficient in backward).

On a GPU a row block is the whole chunk (``R = C``: fewer, larger kernels), so one chunk costs
``C·n·(e + 8)`` bytes (from hidden) or ``C·n·8`` (logits given). On a CPU the fp32 temporaries are
swept in row blocks of at most :data:`CPU_BLOCK_BYTES` each, small enough to stay in the core's L2
cache across the 4-6 elementwise passes; the chunk (which sizes the GEMMs of the from-hidden path)
takes the rest of the budget. In both cases ``tile + temporaries <= budget`` whenever one row fits
(a single row is the floor: it is used, with a warning, when even one row exceeds the budget).

The per-token statistics (O(T)), the outputs and the gradients the caller asked for are not
workspace and are not counted; see docs/logprobs.md for the full memory model. (fp64 inputs, used by
gradcheck, reduce in fp64: their temporaries take twice the bytes counted here.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at runtime: the capacity planner imports the defaults
    import torch

logger = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_BUDGET_BYTES = {"cuda": 256 * MIB, "cpu": 64 * MIB}
"""Default workspace per call by device type (other devices use the CUDA figure)."""
CPU_BLOCK_BYTES = 1 * MIB
"""Bytes of one fp32 temporary row block on CPU (two of them live at once: 2 MiB = one L2)."""
FP32 = 4


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Chunking of one call.

    Attributes:
        chunk: tokens per chunk (the from-hidden path's logits tile and GEMM height).
        block: rows per fp32 temporary block (``<= chunk``).
        workspace_bytes: bytes of the tile plus the two fp32 block temporaries.
    """

    chunk: int
    block: int
    workspace_bytes: int


def default_budget(device: torch.device) -> int:
    """The default workspace budget in bytes for ``device``."""
    return DEFAULT_BUDGET_BYTES.get(device.type, DEFAULT_BUDGET_BYTES["cuda"])


def plan_chunks(num_tokens: int, vocab_local: int, elt_size: int, device: torch.device, *,
                tile: bool, budget_bytes: int | None = None,
                chunk_size: int | None = None) -> ChunkPlan:
    """Tokens per chunk and rows per fp32 block so that the workspace stays within the budget.

    Args:
        num_tokens: T, tokens in the call.
        vocab_local: n = V/tp, this rank's vocabulary columns (padding excluded).
        elt_size: bytes per element of the input (logits or hidden) dtype.
        device: where the call runs (``cpu``: cache-sized row blocks; else row block = chunk).
        tile: True when the call materialises a ``[C, n]`` logits tile (from-hidden path).
        budget_bytes: workspace budget; None = :func:`default_budget`.
        chunk_size: explicit tokens per chunk (overrides the budget; kept for tests/benchmarks).

    Returns:
        The :class:`ChunkPlan`; ``chunk`` and ``block`` are in ``[1, max(T, 1)]``.

    Raises:
        ValueError: a non-positive or non-int ``chunk_size`` / ``budget_bytes``.
    """
    for name, v in (("chunk_size", chunk_size), ("budget_bytes", budget_bytes)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int or None, got {v!r}")
    t = max(num_tokens, 1)
    n = max(vocab_local, 1)
    row_tmp = 2 * n * FP32  # two fp32 temporaries per row
    row_tile = n * elt_size if tile else 0
    cpu = device.type == "cpu"
    if chunk_size is not None:
        chunk = min(chunk_size, t)
        block = min(chunk, max(1, CPU_BLOCK_BYTES // (n * FP32))) if cpu else chunk
    else:
        budget = default_budget(device) if budget_bytes is None else budget_bytes
        if cpu:
            block = min(t, max(1, CPU_BLOCK_BYTES // (n * FP32)), max(1, budget // (row_tmp + row_tile)))
            chunk = max(block, (budget - block * row_tmp) // row_tile) if tile else block
        else:
            block = chunk = max(1, budget // (row_tmp + row_tile))
        chunk, block = min(chunk, t), min(block, chunk, t)
        if row_tmp + row_tile > budget:
            logger.warning("log-prob budget %d B is below one token row (%d B at V/tp=%d): using one "
                           "row per chunk", budget, row_tmp + row_tile, vocab_local)
    return ChunkPlan(chunk=chunk, block=block,
                     workspace_bytes=(chunk if tile else 0) * row_tile + block * row_tmp)


def chunk_bounds(num_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` covering ``[0, T)``: the short remainder first, then full chunks.

    The from-hidden forward walks them in order, so its tile ends up holding the last, full chunk;
    backward walks them in reverse and starts from that tile without recomputing it.
    """
    rem = num_tokens % chunk
    starts = ([0] if rem else []) + list(range(rem, num_tokens, chunk))
    return [(s, min(s + (rem if s == 0 and rem else chunk), num_tokens)) for s in starts]

"""Row orders between HF's separate Gated DeltaNet projections and the trainer's per-rank fused ones.

HF (Qwen3.5) keeps, per linear-attention layer, ``in_proj_qkv`` ``[2·n_k·d_k + n_v·d_v, h]`` (rows
``q | k | v``, heads in order), ``in_proj_z`` ``[n_v·d_v, h]``, ``in_proj_b`` and ``in_proj_a``
``[n_v, h]``, and ``conv1d.weight`` ``[2·n_k·d_k + n_v·d_v, 1, K]`` (channels ``q | k | v``).
The trainer (``gdn.GatedDeltaNet``) fuses the four projections into one column-parallel weight
whose rank-``r`` slice is ``[q_r | k_r | v_r | z_r | b_r | a_r]`` and keeps conv rows
``[q_r | k_r | v_r]`` per rank, where ``x_r`` is rank ``r``'s heads of ``x``. Everything here is a
row permutation (exact, invertible), computed from the sizes alone; no torch.distributed.
"""

from __future__ import annotations

import torch

from megatron_maspo.model.gdn_dims import GdnDims

__all__ = ["GdnDims", "conv_order", "conv_rows_for_rank", "fuse_conv", "fuse_in_proj", "in_proj_order",
           "split_conv", "split_in_proj"]


def _segments(dims: GdnDims) -> list[tuple[int, int]]:
    """``(start in HF order, rows)`` of q, k, v, z, b, a; each is head-major, so an even split of
    its rows over ``tp`` ranks gives each rank whole heads (``n_k % tp == 0`` and ``n_v % n_k == 0``)."""
    out, start = [], 0
    for total in dims.part_sizes():
        out.append((start, total))
        start += total
    return out


def _order(dims: GdnDims, tp: int, parts: int) -> torch.Tensor:
    """HF row index of each fused row, over the first ``parts`` segments (6: in_proj, 3: conv)."""
    segs = _segments(dims)[:parts]
    rows = []
    for r in range(tp):
        for start, total in segs:
            n = total // tp
            rows.append(torch.arange(start + r * n, start + (r + 1) * n))
    return torch.cat(rows)


def in_proj_order(dims: GdnDims, tp: int) -> torch.Tensor:
    """``[P]`` long: fused row ``i`` (all ranks' slices in rank order) = row ``order[i]`` of
    ``cat([in_proj_qkv, in_proj_z, in_proj_b, in_proj_a])``."""
    return _order(dims, tp, 6)


def conv_order(dims: GdnDims, tp: int) -> torch.Tensor:
    """``[C]`` long: fused conv row ``i`` = HF conv channel ``order[i]``."""
    return _order(dims, tp, 3)


def conv_rows_for_rank(dims: GdnDims, tp: int, rank: int) -> torch.Tensor:
    """HF conv channels held by TP rank ``rank`` (in the rank's order ``q_r | k_r | v_r``)."""
    per = dims.conv_channels(tp)
    return conv_order(dims, tp)[rank * per:(rank + 1) * per]


def fuse_in_proj(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, dims: GdnDims,
                 tp: int) -> torch.Tensor:
    """HF's four projections → the fused ``[P, h]`` weight (``tp`` even row slices = the ranks')."""
    return torch.cat([qkv, z, b, a], dim=0)[in_proj_order(dims, tp)]


def split_in_proj(fused: torch.Tensor, dims: GdnDims, tp: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_in_proj`: ``(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)``."""
    hf = torch.empty_like(fused)
    hf[in_proj_order(dims, tp)] = fused
    qk, _, vd, _, nv, _ = dims.part_sizes()
    return tuple(hf.split([2 * qk + vd, vd, nv, nv], dim=0))  # type: ignore[return-value]


def fuse_conv(conv: torch.Tensor, dims: GdnDims, tp: int) -> torch.Tensor:
    """HF ``conv1d.weight`` ``[C, 1, K]`` → the trainer's ``[C, 1, K]`` with its rows in rank order."""
    return conv[conv_order(dims, tp)]


def split_conv(fused: torch.Tensor, dims: GdnDims, tp: int) -> torch.Tensor:
    """Inverse of :func:`fuse_conv`: HF's ``[C, 1, K]``."""
    hf = torch.empty_like(fused)
    hf[conv_order(dims, tp)] = fused
    return hf

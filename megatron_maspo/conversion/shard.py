"""Pure tensor-parallel split/merge functions and vocab padding (conversion-rules.md §4-§6).

No process groups here: ``*_shard`` returns what TP rank ``rank`` of ``tp`` holds, ``*_merge`` takes
the list of all ranks' shards (in rank order) and rebuilds the full tensor. Fused QKV and gate||up
have their own pair because their TP layout is not a plain chunk of the HF tensors.

Shapes: ``NH`` query heads, ``G`` KV groups, ``hd`` head dim, ``H`` hidden (absent for biases).

TP > G (fewer KV heads than TP ranks): Megatron-Core keeps contiguous row chunks of the grouped
fused tensor (a rank holds part of a group), so :func:`qkv_shard`/:func:`qkv_merge` just chunk it and
round-trip for any ``tp`` dividing ``(NH + 2G)·hd``. Our Megatron models still refuse ``G % tp != 0``
(``ArchSpec.validate_layout``); rollout engines that replicate KV heads (vLLM) receive full HF
tensors from the export and shard them themselves, so no replicating split is needed here.
"""

from __future__ import annotations

import torch


def _check_div(n: int, tp: int, what: str) -> None:
    if tp < 1 or n % tp:
        raise ValueError(f"{what}: size {n} is not divisible by tensor_model_parallel_size={tp}")


def tp_shard(full: torch.Tensor, dim: int | None, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous chunk of ``full`` along ``dim`` (``None``: replicated, returned as is)."""
    if dim is None or tp == 1:
        return full
    _check_div(full.shape[dim], tp, f"tensor of shape {tuple(full.shape)} split on dim {dim}")
    return full.chunk(tp, dim=dim)[rank]


def tp_merge(parts: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    """Inverse of :func:`tp_shard` over all ranks (replicated: the first part)."""
    if dim is None or len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=dim)


def qkv_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
             num_groups: int) -> torch.Tensor:
    """HF q ``[NH·hd, *]``, k/v ``[G·hd, *]`` -> Megatron grouped ``[(NH + 2G)·hd, *]``.

    Row order: for g in 0..G-1: query heads g·NH/G .. (g+1)·NH/G - 1, key head g, value head g.
    """
    if num_heads % num_groups:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_query_groups={num_groups}")
    if k.shape != v.shape or k.shape[0] % num_groups or q.shape[0] * num_groups != k.shape[0] * num_heads:
        raise ValueError(f"q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} do not match "
                         f"num_attention_heads={num_heads}, num_query_groups={num_groups}")
    rest = tuple(q.shape[1:])
    fused = torch.cat([q.reshape(num_groups, -1, *rest), k.reshape(num_groups, -1, *rest),
                       v.reshape(num_groups, -1, *rest)], dim=1)
    return fused.reshape(-1, *rest)


def qkv_split(fused: torch.Tensor, num_heads: int, num_groups: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`qkv_fuse`: grouped ``[(NH + 2G)·hd, *]`` -> (q, k, v) in HF layout."""
    per_group = (num_heads // num_groups + 2) * head_dim
    if fused.shape[0] != num_groups * per_group:
        raise ValueError(f"fused QKV has {fused.shape[0]} rows; expected (NH + 2G)·hd = "
                         f"{num_groups * per_group} for NH={num_heads}, G={num_groups}, hd={head_dim}")
    rest = tuple(fused.shape[1:])
    g = fused.reshape(num_groups, per_group, *rest)
    nq = num_heads // num_groups * head_dim
    q, k, v = g.split([nq, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def qkv_shard(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int,
              tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s rows of the fused QKV: a contiguous chunk of the grouped tensor."""
    return tp_shard(qkv_fuse(q, k, v, num_heads, num_groups), 0, tp, rank)


def qkv_merge(parts: list[torch.Tensor], num_heads: int, num_groups: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All TP ranks' fused QKV shards -> HF (q, k, v)."""
    return qkv_split(torch.cat(parts, dim=0), num_heads, num_groups, head_dim)


def gated_shard(gate: torch.Tensor, up: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Megatron gated ``linear_fc1`` shard ``[gate.chunk(t)[r]; up.chunk(t)[r]]`` (``[2F/t, H]``)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate_proj shape {tuple(gate.shape)} != up_proj shape {tuple(up.shape)}")
    return torch.cat([tp_shard(gate, 0, tp, rank), tp_shard(up, 0, tp, rank)], dim=0)


def gated_merge(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """All TP ranks' ``linear_fc1`` shards -> HF (gate ``[F, H]``, up ``[F, H]``)."""
    halves = [p.chunk(2, dim=0) for p in parts]
    return torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)


def pad_vocab(t: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Append zero rows to a ``[V, H]`` embedding/head up to ``[Vp, H]`` (Megatron-LM's rule, §6)."""
    if padded_rows < t.shape[0]:
        raise ValueError(f"padded vocab {padded_rows} < vocab rows {t.shape[0]}")
    if padded_rows == t.shape[0]:
        return t
    return torch.cat([t, t.new_zeros(padded_rows - t.shape[0], *t.shape[1:])], dim=0)


def unpad_vocab(t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Drop Megatron's padding rows: ``[Vp, H]`` -> ``[V, H]``."""
    if t.shape[0] < vocab_size:
        raise ValueError(f"embedding has {t.shape[0]} rows < vocab_size={vocab_size}")
    return t[:vocab_size]


def _rope_order(rows: int, block: int, rope: int, *, interleave: bool) -> torch.Tensor:
    """Row index of a ``[rows, *]`` tensor whose every ``block`` rows end in ``rope`` rotary rows.

    ``interleave``: rotate-half order ``(h_0 .. h_{r/2-1}; h_{r/2} .. h_{r-1})`` -> pairs
    ``(h_0, h_{r/2}, h_1, h_{r/2+1}, ..)``; otherwise the inverse (megatron-core's MLA RoPE de-interleave).
    """
    if rope % 2 or block < rope or rows % block:
        raise ValueError(f"rotary rows: {rows} rows in blocks of {block} ending in {rope} rotary rows")
    half = rope // 2
    pairs = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
    within = pairs if interleave else torch.argsort(pairs)
    one = torch.cat([torch.arange(block - rope), block - rope + within])
    return (torch.arange(rows // block).view(-1, 1) * block + one).reshape(-1)


def rope_rows_to_megatron(t: torch.Tensor, block: int, rope: int) -> torch.Tensor:
    """HF rotate-half rotary rows -> the interleaved pairs megatron-core's MLA RoPE de-interleaves."""
    return t.index_select(0, _rope_order(t.shape[0], block, rope, interleave=True))


def rope_rows_to_hf(t: torch.Tensor, block: int, rope: int) -> torch.Tensor:
    """Inverse of :func:`rope_rows_to_megatron`."""
    return t.index_select(0, _rope_order(t.shape[0], block, rope, interleave=False))


def rope_block(rope_rows: str, spec, rows: int) -> tuple[int, int] | None:
    """``(block, rotary rows)`` of an MLA weight whose HF rows need the rotary reorder for ``spec``
    (None when the checkpoint already keeps megatron's interleaved pairs, or the entry has no rotary rows).
    ``spec`` is an ``ArchSpec``; ``rows`` the full tensor's row count (a ``"tail"`` block is all of it)."""
    if not rope_rows or spec.mla_rope_interleave:
        return None
    block = spec.qk_head_dim + spec.qk_pos_emb_head_dim if rope_rows == "per_head" else rows
    return block, spec.qk_pos_emb_head_dim

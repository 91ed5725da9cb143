"""TP shard/merge of Qwen3.5's fused entries (``model/families/hybrid_names.py``); pure functions.

``hf_to_megatron`` and ``megatron_to_hf`` call :func:`shard` / :func:`merge` for these entry types;
the row orders are exact permutations, so a round trip is bitwise.
"""

from __future__ import annotations

import torch

from megatron_maspo.conversion.shard import tp_shard
from megatron_maspo.model import gdn_layout
from megatron_maspo.model.families.hybrid_names import GatedQKV, GdnConv, GdnInProj
from megatron_maspo.model.spec import ArchSpec

HYBRID_ENTRIES = (GatedQKV, GdnInProj, GdnConv)


def gated_qkv_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
                   num_groups: int) -> torch.Tensor:
    """HF q ``[NH·2hd, H]`` (per head query then gate), k/v ``[G·hd, H]`` -> grouped
    ``[G·(2·NH/G + 2)·hd, H]``: per group its queries, its gates, its key, its value."""
    hd = k.shape[0] // num_groups
    rest = tuple(q.shape[1:])
    qg = q.reshape(num_heads, 2, hd, *rest)
    per = num_heads // num_groups
    query, gate = (qg[:, i].reshape(num_groups, per * hd, *rest) for i in (0, 1))
    fused = torch.cat([query, gate, k.reshape(num_groups, hd, *rest), v.reshape(num_groups, hd, *rest)], dim=1)
    return fused.reshape(-1, *rest)


def gated_qkv_split(fused: torch.Tensor, num_heads: int, num_groups: int,
                    head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`gated_qkv_fuse`."""
    per = num_heads // num_groups
    rest = tuple(fused.shape[1:])
    want = num_groups * (2 * per + 2) * head_dim
    if fused.shape[0] != want:
        raise ValueError(f"gated QKV has {fused.shape[0]} rows; expected {want}")
    g = fused.reshape(num_groups, (2 * per + 2) * head_dim, *rest)
    query, gate, k, v = g.split([per * head_dim, per * head_dim, head_dim, head_dim], dim=1)
    q = torch.stack([query.reshape(num_heads, head_dim, *rest), gate.reshape(num_heads, head_dim, *rest)], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def shard(entry: object, hf: list[torch.Tensor], spec: ArchSpec, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s Megatron tensor of a hybrid entry from its full HF tensors."""
    if isinstance(entry, GatedQKV):
        return tp_shard(gated_qkv_fuse(hf[0], hf[1], hf[2], spec.num_attention_heads, spec.num_query_groups),
                        0, tp, rank)
    dims = _dims(spec)
    if isinstance(entry, GdnInProj):
        return gdn_layout.fuse_in_proj(hf[0], hf[1], hf[2], hf[3], dims, tp).chunk(tp, 0)[rank]
    assert isinstance(entry, GdnConv)
    return gdn_layout.fuse_conv(hf[0], dims, tp).chunk(tp, 0)[rank]


def merge(entry: object, parts: list[torch.Tensor], spec: ArchSpec) -> list[torch.Tensor]:
    """All TP ranks' shards of a hybrid entry -> its full HF tensors (entry order)."""
    full, tp = torch.cat(parts, dim=0), len(parts)
    if isinstance(entry, GatedQKV):
        return list(gated_qkv_split(full, spec.num_attention_heads, spec.num_query_groups, spec.kv_channels))
    dims = _dims(spec)
    if isinstance(entry, GdnInProj):
        return list(gdn_layout.split_in_proj(full, dims, tp))
    assert isinstance(entry, GdnConv)
    return [gdn_layout.split_conv(full, dims, tp)]


def _dims(spec: ArchSpec) -> gdn_layout.GdnDims:
    if not spec.linear_attention:
        raise ValueError(f"ArchSpec(family={spec.family!r}) has no linear_attention sizes")
    return gdn_layout.GdnDims(**spec.linear_attention)


def hf_shape(name: str, spec: ArchSpec) -> tuple[int, ...] | None:
    """Shape of a Qwen3.5-only HF tensor (linear attention, gated ``q_proj``, shared expert), or None."""
    h = spec.hidden_size
    if spec.attention_output_gate and name.endswith("self_attn.q_proj.weight"):
        return (2 * spec.num_attention_heads * spec.kv_channels, h)
    if ".shared_expert." in name and spec.moe_shared_expert_intermediate_size:
        f = spec.moe_shared_expert_intermediate_size
        return (h, f) if name.endswith("down_proj.weight") else (f, h)
    if name.endswith("shared_expert_gate.weight"):
        return (1, h)
    if ".linear_attn." not in name or not spec.linear_attention:
        return None
    d = gdn_layout.GdnDims(**spec.linear_attention)
    qk, _, vd, _, nv, _ = d.part_sizes()
    rules = {"in_proj_qkv.weight": (2 * qk + vd, h), "in_proj_z.weight": (vd, h), "in_proj_b.weight": (nv, h),
             "in_proj_a.weight": (nv, h), "conv1d.weight": (2 * qk + vd, 1, d.conv_kernel), "A_log": (nv,),
             "dt_bias": (nv,), "norm.weight": (d.value_head_dim,), "out_proj.weight": (h, vd)}
    for suffix, shape in rules.items():
        if name.endswith(suffix):
            return shape
    return None

"""Name-table entries of Qwen3.5's layers (plain data, as ``names.py``): the gated full-attention QKV
and the Gated DeltaNet's fused input projection and conv. Each is fused along dim 0, then split over
TP in contiguous rank slices; ``conversion/hybrid_shard.py`` reads them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatedQKV:
    """HF ``q_proj`` (per head ``[query_h | gate_h]``, ``[2·NH·hd, H]``), ``k_proj``, ``v_proj`` <->
    Megatron ``linear_qkv`` with the output gate: for g in 0..G-1, [NH/G query heads, NH/G gate heads,
    key head g, value head g] (megatron-core's ``attention_output_gate`` layout)."""

    q: str
    k: str
    v: str
    mcore: str
    when: None = None
    split: int = 0

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v)


@dataclass(frozen=True)
class GdnInProj:
    """HF ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` <-> the trainer's fused
    ``in_proj`` (rank r: ``[q_r | k_r | v_r | z_r | b_r | a_r]``, ``model/gdn_layout.py``)."""

    qkv: str
    z: str
    b: str
    a: str
    mcore: str
    when: None = None
    split: int = 0

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.qkv, self.z, self.b, self.a)


@dataclass(frozen=True)
class GdnConv:
    """HF ``conv1d.weight`` ``[C, 1, K]`` (channels ``q | k | v``) <-> the trainer's ``conv_weight``
    ``[C, 1, K]`` with rows in rank order (rank r: ``[q_r | k_r | v_r]``)."""

    hf: str
    mcore: str
    when: None = None
    split: int = 0

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,)

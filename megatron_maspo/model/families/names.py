"""Declarative HF <-> Megatron-Core name-table entries (conversion-rules.md §2-§5).

Plain data, so a family declaration (``model/families/<family>.py``) can hold its own table without
importing ``conversion/``; ``conversion/mapping.py`` re-exports these types and adds what reads them.

A family table is a tuple of mapping entries. Names are templates: ``{layer}`` is the GLOBAL layer
index on the HF side and the stage-LOCAL index on the Megatron side (the planner substitutes both);
``{expert}`` is the global expert id on the HF side and ``{local_expert}`` the id on this EP rank
(``expert = ep_rank * experts_per_rank + local_expert``). Split dimensions live here, never in a
parameter's ``partition_dim`` attribute (wrong for grouped expert ``linear_fc2``, conversion-rules.md §5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_maspo.model.families.hybrid_names import GatedQKV, GdnConv, GdnInProj

Condition = Literal["qkv_bias", "qk_norm", "untied", "expert_bias", "shared_expert", "dense_layer", "moe_layer",
                    "q_lora", "no_q_lora"]
"""When an entry exists: a spec flag (``qkv_bias``, ``qk_norm``, ``untied``, ``expert_bias`` (the router's
correction bias), ``shared_expert``), the kind of its layer (``dense_layer``: a dense MLP among MoE
layers, HF ``first_k_dense_replace``; ``moe_layer``: a layer with routed experts), or ``q_lora`` /
``no_q_lora`` (multi-latent attention with / without the low-rank query projection). ``expert_bias`` and
``shared_expert`` entries exist in MoE layers only."""

RopeRows = Literal["per_head", "tail"]
"""Where an MLA weight keeps rotary rows: the last ``qk_pos_emb_head_dim`` rows of every head's
``qk_head_dim + qk_pos_emb_head_dim`` block (query projections), or of the whole tensor (the KV down
projection, ``[kv_lora_rank + d_r, H]``)."""


@dataclass(frozen=True)
class Direct:
    """One HF tensor <-> one Megatron tensor.

    ``split`` is the TP split dim (0: column-parallel, 1: row-parallel, None: replicated);
    ``vocab`` marks vocab-parallel rows padded from V to Vp; ``fp32`` tensors keep float32 on export
    whatever the export dtype (the router's correction bias, which HF also keeps in fp32).
    """

    hf: str
    mcore: str
    split: int | None = None
    vocab: bool = False
    when: Condition | None = None
    fp32: bool = False
    rope_rows: RopeRows | None = None
    """MLA rotary rows, interleaved on import when the HF checkpoint keeps them in rotate-half order
    (``ArchSpec.mla_rope_interleave=False``) and restored on export (``conversion/shard.py``)."""

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,)


@dataclass(frozen=True)
class QKV:
    """HF ``q``, ``k``, ``v`` (weights ``[*, H]`` or biases) <-> Megatron fused ``linear_qkv``,
    grouped per KV head: for g in 0..G-1, [NH/G query heads, key head g, value head g] (§4)."""

    q: str
    k: str
    v: str
    mcore: str
    when: Condition | None = None
    split: int = 0

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v)


@dataclass(frozen=True)
class GatedMLP:
    """HF ``gate_proj`` + ``up_proj`` <-> Megatron ``linear_fc1``; TP rank r holds
    ``[gate.chunk(t)[r]; up.chunk(t)[r]]`` (§5)."""

    gate: str
    up: str
    mcore: str
    when: Condition | None = None
    split: int = 0

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.gate, self.up)


Entry = Direct | QKV | GatedMLP | GatedQKV | GdnInProj | GdnConv


@dataclass(frozen=True)
class FamilyTable:
    """All mappings of one HF family: ``pre`` (embedding, first stage), ``layer`` (per decoder layer;
    entries with ``{expert}`` are repeated for every expert) and ``post`` (final norm, head)."""

    family: str
    pre: tuple[Entry, ...]
    layer: tuple[Entry, ...]
    post: tuple[Entry, ...]

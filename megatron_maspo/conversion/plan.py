"""Expand a family table for one spec into concrete names, shapes and per-stage ownership.

Global order (used for the export and for :func:`hf_state_dict_keys`): the ``pre`` entries, then
every layer's entries in table order (an expert entry lists experts 0..E-1), then ``post``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_maspo.conversion.families import family_table
from megatron_maspo.conversion.hybrid_shard import hf_shape as hybrid_hf_shape
from megatron_maspo.conversion.mapping import Entry, enabled, fill, is_expert
from megatron_maspo.model.checkpoint import unwrap
from megatron_maspo.model.families.registry import get_family
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.model.te_names import spellings

__all__ = ["Item", "chunk_layers", "chunk_tensors", "global_items", "hf_shape", "hf_state_dict_keys", "local_items",
           "mcore_names", "resolve", "unwrap"]


@dataclass(frozen=True)
class Item:
    """One table entry at one (global) layer; ``layer`` is None for embedding/final norm/head."""

    entry: Entry
    section: str
    layer: int | None = None

    def hf_names(self, spec: ArchSpec) -> list[str]:
        """HF keys this item covers: one per entry name, times every expert for expert entries."""
        experts = range(spec.num_moe_experts or 0) if is_expert(self.entry) else [None]
        return [fill(n, layer=self.layer, expert=e) for e in experts for n in self.entry.hf_names]


def global_items(spec: ArchSpec) -> list[Item]:
    """Every mapping that exists for ``spec``, in the global order."""
    table = family_table(spec)
    items = [Item(e, "pre") for e in table.pre if enabled(e, spec)]
    for layer in range(spec.num_layers):
        items += [Item(e, "layer", layer) for e in layer_entries(spec, layer) if enabled(e, spec, layer)]
    items += [Item(e, "post") for e in table.post if enabled(e, spec)]
    return items


def layer_entries(spec: ArchSpec, layer: int) -> tuple[Entry, ...]:
    """Table entries of global layer ``layer``: the family's entries for the layer's attention kind
    (``ModelFamily.layer_names_by_kind``, Qwen3.5's linear / full layers), then the shared ``layer`` ones."""
    by_kind = get_family(spec.family).layer_names_by_kind
    return (*by_kind.get(spec.layer_kind(layer), ()), *family_table(spec).layer)


def hf_state_dict_keys(spec: ArchSpec) -> list[str]:
    """The exact safetensors key set of an HF checkpoint of ``spec`` (tied: no ``lm_head.weight``)."""
    return [name for item in global_items(spec) for name in item.hf_names(spec)]


def hf_shape(name: str, spec: ArchSpec) -> tuple[int, ...]:
    """Shape of HF tensor ``name`` for ``spec`` (``ValueError`` if the name is not one of its keys)."""
    if (special := hybrid_hf_shape(name, spec)) is not None:
        return special
    h, hd = spec.hidden_size, spec.kv_channels
    nq, nkv = spec.num_attention_heads * hd, spec.num_query_groups * hd
    f = spec.moe_ffn_hidden_size if ".experts." in name else spec.ffn_hidden_size
    if ".shared_experts." in name:
        f = spec.moe_shared_expert_intermediate_size
    rules = {
        "embed_tokens.weight": (spec.vocab_size, h), "lm_head.weight": (spec.vocab_size, h),
        "layernorm.weight": (h,), "model.norm.weight": (h,), "q_norm.weight": (hd,),
        "k_norm.weight": (hd,), "q_proj.weight": (nq, h), "k_proj.weight": (nkv, h),
        "v_proj.weight": (nkv, h), "q_proj.bias": (nq,), "k_proj.bias": (nkv,), "v_proj.bias": (nkv,),
        "o_proj.weight": (h, nq), "gate_proj.weight": (f, h), "up_proj.weight": (f, h),
        "down_proj.weight": (h, f), "mlp.gate.weight": (spec.num_moe_experts or 0, h),
        "mlp.gate.e_score_correction_bias": (spec.num_moe_experts or 0,),
    }
    if spec.is_mla:  # checked first: "kv_a_layernorm.weight" also ends in "layernorm.weight"
        rules = {**_mla_shapes(spec), **rules}
    for suffix, shape in rules.items():
        if name.endswith(suffix):
            return shape
    raise ValueError(f"HF tensor {name!r} is not part of a {spec.family} checkpoint")


def _mla_shapes(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    """HF shapes of the multi-latent attention tensors (``o_proj`` is the generic rule: ``kv_channels`` is
    the value head dim)."""
    h, nh, q, kv = spec.hidden_size, spec.num_attention_heads, spec.q_lora_rank or 0, spec.kv_lora_rank or 0
    qk = nh * (spec.qk_head_dim + spec.qk_pos_emb_head_dim)
    return {"q_a_proj.weight": (q, h), "q_a_layernorm.weight": (q,), "q_b_proj.weight": (qk, q),
            "self_attn.q_proj.weight": (qk, h), "kv_a_proj_with_mqa.weight": (kv + spec.qk_pos_emb_head_dim, h),
            "kv_a_layernorm.weight": (kv,), "kv_b_proj.weight": (nh * (spec.qk_head_dim + spec.kv_channels), kv)}


def chunk_tensors(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors conversion maps in a chunk: its parameters and the routers' persistent ``expert_bias``
    buffers (the correction bias is state, not a trained parameter, yet part of the checkpoint)."""
    model = unwrap(chunk)
    out = dict(model.named_parameters())
    out.update((n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias"))
    return out


def chunk_layers(chunk: torch.nn.Module) -> list[int]:
    """Global 0-based layer ids of a ``GPTModel`` chunk (``layer_number`` is global and 1-based)."""
    return [layer.layer_number - 1 for layer in unwrap(chunk).decoder.layers]


def mcore_names(item: Item, local_layer: int | None, spec: ArchSpec, ep: int,
                ep_rank: int) -> list[tuple[str, int | None]]:
    """Megatron names (stage-local) of ``item`` on this rank, with the global expert id of each."""
    if not is_expert(item.entry):
        return [(fill(item.entry.mcore, layer=local_layer), None)]
    per_rank = (spec.num_moe_experts or 0) // ep
    return [(fill(item.entry.mcore, layer=local_layer, local_expert=j), ep_rank * per_rank + j)
            for j in range(per_rank)]


def resolve(params: dict[str, torch.Tensor], name: str) -> str:
    """The chunk's spelling of the local-spec name ``name``: itself, or its TE-spec name (norm fused into
    the next linear; grouped-GEMM experts ``linear_fc1.weight{j}``), ``model/te_names.py``."""
    for alt in spellings(name):
        if alt in params:
            return alt
    raise ValueError(f"Megatron parameter {name!r} not found in the model chunk under any of its spellings "
                     f"{list(spellings(name))} (wrong spec or table?)")


def local_items(chunk: torch.nn.Module, spec: ArchSpec) -> Iterator[tuple[Item, int | None]]:
    """(item, stage-local layer index) for every mapping this chunk holds."""
    model = unwrap(chunk)
    table = family_table(spec)
    if model.pre_process:
        yield from ((Item(e, "pre"), None) for e in table.pre if enabled(e, spec))
    for i, layer in enumerate(chunk_layers(model)):
        yield from ((Item(e, "layer", layer), i) for e in layer_entries(spec, layer) if enabled(e, spec, layer))
    if model.post_process:
        yield from ((Item(e, "post"), None) for e in table.post if enabled(e, spec))

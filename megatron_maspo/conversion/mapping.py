"""What reads the declarative HF <-> Megatron-Core name tables (conversion-rules.md §2-§5).

The entry types (``Direct``, ``QKV``, ``GatedMLP``, ``FamilyTable``) are plain data declared in
``model/families/names.py`` (each family's declaration holds its own table) and re-exported here. Names
are templates: ``{layer}`` is the GLOBAL layer index on the HF side and the stage-LOCAL index on the
Megatron side (the planner substitutes both); ``{expert}`` is the global expert id on the HF side and
``{local_expert}`` the id on this EP rank (``expert = ep_rank * experts_per_rank + local_expert``).

The same tables drive ``hf_to_megatron`` (load), ``megatron_to_hf`` (export, hence the rollout weight
sync) and :func:`hf_state_dict_keys`.
"""

from __future__ import annotations

from megatron_maspo.model.families.names import QKV, Condition, Direct, Entry, FamilyTable, GatedMLP
from megatron_maspo.model.spec import ArchSpec

__all__ = ["QKV", "Condition", "Direct", "Entry", "FamilyTable", "GatedMLP", "enabled", "fill", "is_expert"]


def is_expert(entry: Entry) -> bool:
    return "{expert}" in entry.hf_names[0]


def enabled(entry: Entry, spec: ArchSpec, layer: int | None = None) -> bool:
    """Whether ``entry`` exists for ``spec`` (at global layer ``layer`` for a layer entry)."""
    w = entry.when
    if w is None:
        return True
    if w in ("q_lora", "no_q_lora"):  # multi-latent attention with / without the low-rank query
        return spec.is_mla and (spec.q_lora_rank is not None) == (w == "q_lora")
    flags = {"qkv_bias": spec.add_qkv_bias, "qk_norm": spec.qk_layernorm, "untied": not spec.tie_word_embeddings,
             "expert_bias": spec.moe_router_expert_bias,
             "shared_expert": bool(spec.moe_shared_expert_intermediate_size), "moe_layer": True, "dense_layer": True}
    if w not in flags:
        raise ValueError(f"unknown mapping condition {w!r}; accepted: {sorted(flags)}, q_lora, no_q_lora")
    if w in ("dense_layer", "moe_layer", "expert_bias", "shared_expert"):
        if layer is None:
            raise ValueError(f"mapping condition {w!r} needs the layer index")
        # the bias and the shared expert live in MoE layers only
        if spec.is_moe_layer(layer) != (w != "dense_layer"):
            return False
    return flags[w]


def fill(template: str, **kw: int) -> str:
    """Substitute ``{layer}``/``{expert}``/``{local_expert}`` in a name template."""
    return template.format(**kw) if "{" in template else template

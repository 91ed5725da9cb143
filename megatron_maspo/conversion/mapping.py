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


def enabled(entry: Entry, spec: ArchSpec) -> bool:
    """Whether ``entry`` exists for ``spec`` (its ``when`` condition holds)."""
    if entry.when is None:
        return True
    if entry.when == "qkv_bias":
        return spec.add_qkv_bias
    if entry.when == "qk_norm":
        return spec.qk_layernorm
    if entry.when == "untied":
        return not spec.tie_word_embeddings
    if entry.when in ("q_lora", "no_q_lora"):
        return spec.is_mla and (spec.q_lora_rank is not None) == (entry.when == "q_lora")
    raise ValueError(f"unknown mapping condition {entry.when!r}; accepted: qkv_bias, qk_norm, untied, q_lora, "
                     "no_q_lora")


def fill(template: str, **kw: int) -> str:
    """Substitute ``{layer}``/``{expert}``/``{local_expert}`` in a name template."""
    return template.format(**kw) if "{" in template else template

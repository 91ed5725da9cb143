"""One declarative HF <-> Megatron-Core (local and TE spec names) table per supported family.

HF names are safetensors checkpoint keys (what ``save_pretrained`` writes and vLLM's
``load_weights`` expects), never transformers-5 in-memory names: Qwen3-MoE experts are per-expert
here although transformers fuses them in memory (conversion-rules.md §9).
"""

from __future__ import annotations

from megatron_maspo.conversion.mapping import QKV, Direct, Entry, FamilyTable, GatedMLP
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.model.te_names import FUSED_NORMS

_A = "model.layers.{layer}.self_attn."
_M = "decoder.layers.{layer}."

_PRE: tuple[Entry, ...] = (
    Direct("model.embed_tokens.weight", "embedding.word_embeddings.weight", split=0, vocab=True),
)
_POST: tuple[Entry, ...] = (
    Direct("model.norm.weight", "decoder.final_layernorm.weight"),
    Direct("lm_head.weight", "output_layer.weight", split=0, vocab=True, when="untied"),
)
_ATTENTION: tuple[Entry, ...] = (
    Direct("model.layers.{layer}.input_layernorm.weight", _M + "input_layernorm.weight"),
    QKV(_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight",
        _M + "self_attention.linear_qkv.weight"),
    QKV(_A + "q_proj.bias", _A + "k_proj.bias", _A + "v_proj.bias",
        _M + "self_attention.linear_qkv.bias", when="qkv_bias"),
    Direct(_A + "q_norm.weight", _M + "self_attention.q_layernorm.weight", when="qk_norm"),
    Direct(_A + "k_norm.weight", _M + "self_attention.k_layernorm.weight", when="qk_norm"),
    Direct(_A + "o_proj.weight", _M + "self_attention.linear_proj.weight", split=1),
    Direct("model.layers.{layer}.post_attention_layernorm.weight", _M + "pre_mlp_layernorm.weight"),
)
_DENSE_MLP: tuple[Entry, ...] = (
    GatedMLP("model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight",
             _M + "mlp.linear_fc1.weight"),
    Direct("model.layers.{layer}.mlp.down_proj.weight", _M + "mlp.linear_fc2.weight", split=1),
)
_E = "model.layers.{layer}.mlp.experts.{expert}."
_LE = _M + "mlp.experts.local_experts.{local_expert}."
# SequentialMLP names (local spec; TE spec without grouped GEMM); TEGroupedMLP's ``weight{j}`` spellings
# resolve through model/te_names.py. Expert TP is 1 on CPU (MoE needs
# TP=1 without sequence parallelism), so the splits below are those of expert-TP > 1 for reference.
_QWEN3_MOE_MLP: tuple[Entry, ...] = (
    Direct("model.layers.{layer}.mlp.gate.weight", _M + "mlp.router.weight"),
    GatedMLP(_E + "gate_proj.weight", _E + "up_proj.weight", _LE + "linear_fc1.weight"),
    Direct(_E + "down_proj.weight", _LE + "linear_fc2.weight", split=1),
)

FAMILY_TABLES: dict[str, FamilyTable] = {
    "llama": FamilyTable("llama", _PRE, _ATTENTION + _DENSE_MLP, _POST),
    "qwen2": FamilyTable("qwen2", _PRE, _ATTENTION + _DENSE_MLP, _POST),
    "qwen3": FamilyTable("qwen3", _PRE, _ATTENTION + _DENSE_MLP, _POST),
    "qwen3_moe": FamilyTable("qwen3_moe", _PRE, _ATTENTION + _QWEN3_MOE_MLP, _POST),
}

# Megatron names above are the local spec's; the TE spec's spellings (norms fused into the next linear,
# grouped-GEMM experts ``mlp.experts.linear_fc1.weight{j}``) are derived from them by
# ``model/te_names.py`` (recorded from megatron-core 0.16.1), and ``conversion/plan.resolve`` accepts
# every spelling, so one table serves the local spec, the TE spec and TE with grouped GEMM.
TE_RENAMES: dict[str, str] = FUSED_NORMS


def family_table(spec: ArchSpec) -> FamilyTable:
    """The table for ``spec.family``; ``ValueError`` naming the family if there is none."""
    try:
        return FAMILY_TABLES[spec.family]
    except KeyError:
        raise ValueError(f"no conversion table for family={spec.family!r}; accepted: "
                         f"{sorted(FAMILY_TABLES)}") from None

"""Qwen3.5-MoE text model: Qwen3.5's hybrid decoder (``qwen3_5.py``) with routed experts in every layer
(softmax top-k, top-k probabilities always normalised) plus one shared expert whose output is scaled by
``sigmoid(shared_expert_gate(x))``. Reads ``qwen3_5_moe_text`` (``Qwen3_5MoeForCausalLM``; per-expert keys
on disk, as ``save_pretrained`` writes them)."""

from __future__ import annotations

from typing import Any

from megatron_maspo.model.families import llama_style, qwen3_5
from megatron_maspo.model.families.declaration import ModelFamily, SpecFields
from megatron_maspo.model.families.names import Direct, Entry, FamilyTable, GatedMLP
from megatron_maspo.model.families.qwen3_5_presets import MOE_PRESETS
from megatron_maspo.model.families.qwen3_moe import MOE_MLP

_L, _M = "model.layers.{layer}.", "decoder.layers.{layer}."
_SE, _MS = _L + "mlp.shared_expert.", _M + "mlp.shared_experts."
SHARED_EXPERT: tuple[Entry, ...] = (
    GatedMLP(_SE + "gate_proj.weight", _SE + "up_proj.weight", _MS + "linear_fc1.weight"),
    Direct(_SE + "down_proj.weight", _MS + "linear_fc2.weight", split=1),
    Direct(_L + "mlp.shared_expert_gate.weight", _MS + "gate_weight"),
)


def _from_hf(cfg: Any, d: dict) -> SpecFields:
    cfg.intermediate_size = cfg.moe_intermediate_size  # no dense layers: the field is unused
    return dict(llama_style.spec_fields(cfg, d), **qwen3_5.common_fields(cfg, d), num_moe_experts=cfg.num_experts,
                moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_router_topk=cfg.num_experts_per_tok,
                moe_norm_topk_prob=True, moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                moe_shared_expert_gate=True)


def _to_hf(spec: Any) -> dict[str, Any]:
    if not spec.moe_norm_topk_prob or not spec.moe_shared_expert_gate:
        raise ValueError("HF Qwen3.5-MoE always normalises top-k probabilities and gates its shared expert")
    d = qwen3_5.config_json(spec)
    d.pop("intermediate_size")
    return dict(d, num_experts=spec.num_moe_experts, moe_intermediate_size=spec.moe_ffn_hidden_size,
                num_experts_per_tok=spec.moe_router_topk,
                shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
                output_router_logits=False, router_aux_loss_coef=0.0)


FAMILY = ModelFamily(
    name="qwen3_5_moe",
    display_name="Qwen3.5-MoE",
    model_types=("qwen3_5_moe_text",),
    architectures=("Qwen3_5MoeForCausalLM",),
    names=FamilyTable("qwen3_5_moe", llama_style.PRE, (qwen3_5.PRE_MLP_NORM, *MOE_MLP, *SHARED_EXPERT),
                      llama_style.POST),
    from_hf=_from_hf,
    to_hf=_to_hf,
    qk_norm=True,
    moe=True,
    shared_experts=True,
    tiny={k: v for k, v in qwen3_5.TINY.items() if k != "intermediate_size"} | dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        router_aux_loss_coef=0.0),
    presets=MOE_PRESETS,
    layer_names_by_kind=qwen3_5.BY_KIND,
    recurrent_state_bytes=qwen3_5.recurrent_state_bytes,
)

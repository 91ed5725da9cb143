"""GLM-4.5 / GLM-4.5-Air (HF ``glm4_moe``): a Llama-style attention block with QKV biases, optional q/k
RMSNorm (``use_qk_norm``) and partial rotary (``partial_rotary_factor``, rotary on the first half of each
head, the rotate-half layout Megatron's ``rotary_percent`` uses), on the DeepSeekMoE block
(``deepseek_moe.py``: sigmoid router with an fp32 correction bias, group-limited top-k, routed scaling
factor, one shared expert, dense first layers).

Multi-token-prediction layers (``num_nextn_predict_layers``; published GLM-4.5 checkpoints store them as
``model.layers.{num_hidden_layers + i}.*``) are not part of the policy: transformers' ``glm4_moe`` does
not build them, and conversion passes them through by name (``passthrough``), unchanged, from the HF
folder it read to the one it writes (docs/glm4-moe.md).
"""

from __future__ import annotations

from typing import Any

from megatron_maspo.model.families import deepseek_moe, llama_style
from megatron_maspo.model.families.declaration import ModelFamily, SpecFields
from megatron_maspo.model.families.names import FamilyTable


def partial_rotary_factor(d: dict) -> float:
    """HF ``partial_rotary_factor``: in ``rope_parameters`` (transformers 5) or top-level; GLM's default 0.5."""
    params = d.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5)))


def _from_hf(cfg: Any, d: dict) -> SpecFields:
    fields = llama_style.spec_fields(cfg, d)
    mtp = int(d.get("num_nextn_predict_layers", 0) or 0)  # passed through by name, kept in the config
    return dict(fields, rotary_percent=partial_rotary_factor(d), qk_layernorm=bool(cfg.use_qk_norm),
                **deepseek_moe.moe_fields_from_hf(cfg), extra={"num_nextn_predict_layers": mtp} if mtp else {})


def _to_hf(spec: Any) -> dict[str, Any]:
    d = dict(llama_style.config_json(spec), **deepseek_moe.moe_config_json(spec), use_qk_norm=spec.qk_layernorm,
             partial_rotary_factor=spec.rotary_percent, num_nextn_predict_layers=int(spec.extra.get("num_nextn_predict_layers", 0)),
             output_router_logits=False)
    d["rope_parameters"] = dict(d["rope_parameters"], partial_rotary_factor=spec.rotary_percent)
    return d


FAMILY = ModelFamily(
    name="glm4_moe",
    display_name="GLM-4.5",
    model_types=("glm4_moe",),
    architectures=("Glm4MoeForCausalLM",),
    names=FamilyTable("glm4_moe", llama_style.PRE, llama_style.ATTENTION + deepseek_moe.MLP, llama_style.POST),
    from_hf=_from_hf,
    to_hf=_to_hf,
    qk_norm="config",
    moe=True,
    shared_experts=True,
    passthrough=("model.layers.{mtp}.",),
    # Every family-specific feature on: 2 layers (layer 0 dense, layer 1 MoE), 8 experts in 4 groups of 2,
    # top-4 from the best 2 groups (HF's top-2-per-group score = Megatron's top-(4/2)), scaling 2.5, one
    # shared expert, QKV bias, q/k norm, rotary on half of each 16-wide head.
    tiny=dict(llama_style.TINY_COMMON, head_dim=16, intermediate_size=96, tie_word_embeddings=False,
              n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=1,
              n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
              use_qk_norm=True, attention_bias=True, num_nextn_predict_layers=0,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    presets={
        # zai-org/GLM-4.5-Air (106 B total, 12 B active): 46 layers (first dense), 128 experts top-8 + 1 shared,
        # no group limit, sigmoid + correction bias, QKV bias, no q/k norm, rotary on half of each 128 head.
        # Its one MTP layer (model.layers.46.*) is passed through, not counted here.
        "glm-4.5-air": dict(num_layers=46, hidden_size=4096, ffn_hidden_size=10944, num_attention_heads=96,
                            num_query_groups=8, kv_channels=128, vocab_size=151552, max_position_embeddings=131072,
                            rotary_base=1000000.0, rotary_percent=0.5, layernorm_epsilon=1e-5, add_qkv_bias=True,
                            qk_layernorm=False, tie_word_embeddings=False, num_moe_experts=128,
                            moe_ffn_hidden_size=1408, moe_router_topk=8, moe_norm_topk_prob=True,
                            moe_shared_expert_intermediate_size=1408, moe_router_score_function="sigmoid",
                            moe_router_expert_bias=True, moe_router_topk_scaling_factor=1.0, moe_first_k_dense=1,
                            extra={"bos_token_id": None, "eos_token_id": [151329, 151336, 151338],
                                   "pad_token_id": 151329, "num_nextn_predict_layers": 1}),
    },
)

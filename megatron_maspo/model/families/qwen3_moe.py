"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm) with routed experts in every layer (softmax top-k, optional
normalised top-k probabilities, no shared expert).

Experts are per-expert keys on disk (``save_pretrained`` writes them so although transformers fuses them
in memory, conversion-rules.md §9). Dense layers among MoE ones (``decoder_sparse_step``,
``mlp_only_layers``) are refused. Presets: each model's HF ``config.json``.
"""

from __future__ import annotations

from typing import Any

from megatron_maspo.model.families import llama_style
from megatron_maspo.model.families.declaration import ModelFamily, SpecFields
from megatron_maspo.model.families.names import Direct, Entry, FamilyTable, GatedMLP
from megatron_maspo.model.moe_router import router_summary

_M = "decoder.layers.{layer}."
_E = "model.layers.{layer}.mlp.experts.{expert}."
_LE = _M + "mlp.experts.local_experts.{local_expert}."
# SequentialMLP names (local spec; TE spec without grouped GEMM); TEGroupedMLP's ``weight{j}`` spellings
# resolve through model/te_names.py. Expert TP is 1 on CPU (MoE needs
# TP=1 without sequence parallelism), so the splits below are those of expert-TP > 1 for reference.
MOE_MLP: tuple[Entry, ...] = (
    Direct("model.layers.{layer}.mlp.gate.weight", _M + "mlp.router.weight"),
    GatedMLP(_E + "gate_proj.weight", _E + "up_proj.weight", _LE + "linear_fc1.weight"),
    Direct(_E + "down_proj.weight", _LE + "linear_fc2.weight", split=1),
)


def _from_hf(cfg: Any, d: dict) -> SpecFields:
    fields = llama_style.spec_fields(cfg, d)
    if getattr(cfg, "decoder_sparse_step", 1) != 1 or list(getattr(cfg, "mlp_only_layers", []) or []):
        raise ValueError("qwen3_moe with decoder_sparse_step != 1 or non-empty mlp_only_layers "
                         "(dense layers among MoE layers) is not supported")
    return dict(fields, num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
                moe_router_topk=cfg.num_experts_per_tok, moe_norm_topk_prob=bool(cfg.norm_topk_prob))


def _to_hf(spec: Any) -> dict[str, Any]:
    if (spec.moe_router_score_function != "softmax" or spec.moe_router_expert_bias or spec.moe_router_num_groups
            or spec.moe_router_topk_scaling_factor not in (None, 1.0) or spec.moe_first_k_dense):
        raise ValueError(f"ArchSpec(family={spec.family!r}) has router features HF Qwen3-MoE cannot express "
                         f"({router_summary(spec)})")
    return dict(llama_style.config_json(spec), num_experts=spec.num_moe_experts,
                moe_intermediate_size=spec.moe_ffn_hidden_size, num_experts_per_tok=spec.moe_router_topk,
                norm_topk_prob=spec.moe_norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                output_router_logits=False, router_aux_loss_coef=0.0)


FAMILY = ModelFamily(
    name="qwen3_moe",
    display_name="Qwen3",
    model_types=("qwen3_moe",),
    architectures=("Qwen3MoeForCausalLM",),
    names=FamilyTable("qwen3_moe", llama_style.PRE, llama_style.ATTENTION + MOE_MLP, llama_style.POST),
    from_hf=_from_hf,
    to_hf=_to_hf,
    qk_norm=True,
    moe=True,
    # Qwen3-MoE: 4 experts, top-2, normalised top-k probabilities, untied.
    tiny=dict(llama_style.TINY_COMMON, head_dim=16, tie_word_embeddings=False, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
              decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    presets={
        # Qwen/Qwen3-30B-A3B (30.5 B total, 3.3 B active; 128 experts, top-8, QK-norm, head_dim 128)
        "qwen3-30b-a3b": dict(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                              num_query_groups=4, kv_channels=128, vocab_size=151936,
                              max_position_embeddings=40960, rotary_base=1000000.0, layernorm_epsilon=1e-6,
                              qk_layernorm=True, tie_word_embeddings=False, num_moe_experts=128,
                              moe_ffn_hidden_size=768, moe_router_topk=8, moe_norm_topk_prob=True,
                              extra={"bos_token_id": 151643, "eos_token_id": 151645}),
        # Qwen/Qwen3-235B-A22B (235 B total, 22 B active; 94 layers, GQA 64/4 heads of 128, QK-norm,
        # 128 experts of 1536 top-8, normalised top-k, untied)
        "qwen3-235b-a22b": dict(num_layers=94, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=64,
                                num_query_groups=4, kv_channels=128, vocab_size=151936,
                                max_position_embeddings=40960, rotary_base=1000000.0, layernorm_epsilon=1e-6,
                                qk_layernorm=True, tie_word_embeddings=False, num_moe_experts=128,
                                moe_ffn_hidden_size=1536, moe_router_topk=8, moe_norm_topk_prob=True,
                                extra={"bos_token_id": 151643, "eos_token_id": 151645}),
    },
    planning_layouts={
        # A DeepSeek-MoE-style fine-grained-expert layout (16.9 B total, 2.6 B active): 64 small routed
        # experts (FFN 1408), top-6, plus 2 shared experts' worth of always-on FFN (2816), on a Qwen3-style
        # attention block (GQA 16/16 heads of 128, QK-norm) instead of MLA, and no leading dense layer, so
        # the local and TE Megatron specs build it. For planning the expert layout only: no HF family
        # converts it (qwen3_moe has no shared experts).
        "fine-grained-moe-16b": dict(num_layers=28, hidden_size=2048, ffn_hidden_size=10944,
                                     num_attention_heads=16, num_query_groups=16, kv_channels=128,
                                     vocab_size=102400, max_position_embeddings=16384, rotary_base=10000.0,
                                     layernorm_epsilon=1e-6, qk_layernorm=True, tie_word_embeddings=False,
                                     num_moe_experts=64, moe_ffn_hidden_size=1408, moe_router_topk=6,
                                     moe_norm_topk_prob=False, moe_shared_expert_intermediate_size=2816,
                                     extra={"bos_token_id": 100000, "eos_token_id": 100001}),
    },
)

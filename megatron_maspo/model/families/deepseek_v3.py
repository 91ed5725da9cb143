"""DeepSeek-V3 (and R1, V3.1, ... with its ``config.json``): multi-latent attention with YaRN, dense first
layers, then routed experts with a shared expert.

Attention: the MLA tensors map one to one (conversion-rules.md §3), split as megatron-core's local MLA
builds them (down projections column-parallel and gathered after the matmul, up projections
column-parallel per head, ``o_proj`` row-parallel). HF ``rope_interleave=True`` (DeepSeek's own layout)
is what megatron-core's MLA RoPE expects; ``False`` is converted by reordering the rotary weight rows
(``Direct.rope_rows``). YaRN maps field for field (``_yarn``); combinations where transformers and
megatron-core compute different concentration factors are refused.

MLP: the DeepSeekMoE block (``deepseek_moe.py``: layers ``< first_k_dense_replace`` dense, then sigmoid
routing with the fp32 correction bias, group-limited top-k, the routed scaling factor and a shared
expert). All-dense configs (``first_k_dense_replace >= num_hidden_layers``) carry the unused MoE fields
through ``ArchSpec.extra`` so the export writes the same ``config.json``.

Multi-token prediction (``num_nextn_predict_layers``, transformers' ``num_mtp_layers``): the MTP module
is not built in Megatron (RL trains the main model); its count is carried through ``extra`` and
written back on export, and its tensors (``model.layers.{L}.*``) are passed through by name
(``conversion/passthrough.py``). Block-FP8 checkpoints (``quantization_config``, ``weight_scale_inv``) are refused.
"""

from __future__ import annotations

import math
from typing import Any

from megatron_maspo.model.families import deepseek_moe, llama_style
from megatron_maspo.model.families.declaration import TOKEN_ID_KEYS, ModelFamily, SpecFields
from megatron_maspo.model.families.names import Direct, Entry, FamilyTable

_A = "model.layers.{layer}.self_attn."
_M = "decoder.layers.{layer}."
_S = _M + "self_attention."

MLA_ATTENTION: tuple[Entry, ...] = (
    Direct("model.layers.{layer}.input_layernorm.weight", _M + "input_layernorm.weight"),
    Direct(_A + "q_a_proj.weight", _S + "linear_q_down_proj.weight", split=0, when="q_lora"),
    Direct(_A + "q_a_layernorm.weight", _S + "q_layernorm.weight", when="q_lora"),
    Direct(_A + "q_b_proj.weight", _S + "linear_q_up_proj.weight", split=0, when="q_lora", rope_rows="per_head"),
    Direct(_A + "q_proj.weight", _S + "linear_q_proj.weight", split=0, when="no_q_lora", rope_rows="per_head"),
    Direct(_A + "kv_a_proj_with_mqa.weight", _S + "linear_kv_down_proj.weight", split=0, rope_rows="tail"),
    Direct(_A + "kv_a_layernorm.weight", _S + "kv_layernorm.weight"),
    Direct(_A + "kv_b_proj.weight", _S + "linear_kv_up_proj.weight", split=0),
    Direct(_A + "o_proj.weight", _S + "linear_proj.weight", split=1),
    Direct("model.layers.{layer}.post_attention_layernorm.weight", _M + "pre_mlp_layernorm.weight"),
)

# Fields of an all-dense config that do not change its maths, carried through ``ArchSpec.extra``.
_UNUSED_MOE = ("n_routed_experts", "n_shared_experts", "moe_intermediate_size", "num_experts_per_tok",
               "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")
_MTP = "num_nextn_predict_layers"
# transformers' DeepseekV3RMSNorm of q_a_layernorm / kv_a_layernorm takes no eps: always 1e-6.
_LATENT_NORM_EPS = 1e-6


def _m(scale: float, mscale: float) -> float:
    """YaRN's ``m(s, a) = 0.1·a·ln s + 1`` (1 for s <= 1), in transformers and megatron-core alike."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rp: dict, max_pos: int) -> SpecFields:
    """``ArchSpec`` YaRN fields for transformers' ``rope_parameters`` (``rope_type="yarn"``).

    transformers scales cos/sin by ``m(s, mscale)/m(s, mscale_all_dim)`` only when both are non-zero and
    by ``m(s, 1)`` otherwise; megatron-core always uses the ratio, so ``mscale_all_dim`` without
    ``mscale`` (or an explicit ``attention_factor``) has no exact megatron equivalent.
    """
    original = rp.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_parameters.original_max_position_embeddings is required for rope_type='yarn'")
    factor = rp.get("factor") or max_pos / original
    mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
    if mscale_all and not mscale:
        raise ValueError(f"rope_parameters.mscale_all_dim={mscale_all} without mscale: transformers then scales "
                         "cos/sin by m(factor, 1), which megatron-core's YaRN cannot reproduce")
    mscale_m, mscale_all_m = (float(mscale), float(mscale_all)) if mscale and mscale_all else (1.0, 0.0)
    want = _m(factor, mscale_m) / _m(factor, mscale_all_m)
    if rp.get("attention_factor") is not None and not math.isclose(rp["attention_factor"], want, rel_tol=1e-12):
        raise ValueError(f"rope_parameters.attention_factor={rp['attention_factor']} differs from megatron-core's "
                         f"m(factor, mscale)/m(factor, mscale_all_dim) = {want}")
    if rp.get("truncate", True) is not True:
        raise ValueError("rope_parameters.truncate=False: megatron-core's YaRN always rounds the correction range")
    return dict(rope_scaling="yarn", rope_scaling_factor=float(factor), yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(rp.get("beta_fast") or 32), yarn_beta_slow=float(rp.get("beta_slow") or 1),
                yarn_mscale=mscale_m, yarn_mscale_all_dim=mscale_all_m)


_ROUTER_KEYS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
"""DeepSeek-V3's own ``config.json`` router fields (its remote code's names): transformers ignores them, vLLM's
DeepSeek module reads them (without ``topk_method="noaux_tc"`` it builds no correction bias and fails to load
``e_score_correction_bias``; without ``scoring_func`` it routes by softmax). Written on export, checked on
import."""


def _from_hf(cfg: Any, d: dict) -> SpecFields:
    if d.get("quantization_config") or any("weight_scale_inv" in str(k) for k in d):
        qc = d.get("quantization_config") or {}
        raise ValueError(f"deepseek_v3 checkpoint is quantised (quantization_config.quant_method="
                         f"{qc.get('quant_method')!r}, weight_block_size={qc.get('weight_block_size')}): block-FP8 "
                         "weights are not converted; dequantise them to bf16 first (weight * weight_scale_inv "
                         "per 128x128 block) and drop quantization_config")
    if cfg.hidden_act != "silu":
        raise ValueError(f"hidden_act={cfg.hidden_act!r}; only 'silu' (SwiGLU) is supported")
    # transformers' DeepSeek-V3 always routes by sigmoid + correction bias; vLLM follows these two fields, so
    # another value would make the engine run a different router than the trainer (and transformers)
    for key, want in _ROUTER_KEYS.items():
        if d.get(key, want) != want:
            raise ValueError(f"{key}={d[key]!r}: transformers' DeepseekV3 routes as {key}={want!r} whatever it "
                             f"says, vLLM follows it; only {want!r} converts to one model on both")
    if cfg.attention_bias:
        raise ValueError("attention_bias=True (biases on q_a/kv_a/o projections) is not supported for deepseek_v3")
    if cfg.rms_norm_eps != _LATENT_NORM_EPS:
        raise ValueError(f"rms_norm_eps={cfg.rms_norm_eps}: transformers' q/kv latent norms use 1e-6 whatever it "
                         "is, megatron-core one epsilon for every norm; only rms_norm_eps=1e-6 converts exactly")
    rp = dict(cfg.rope_parameters or {})
    kind = rp.get("rope_type", "default")
    if kind not in ("default", "yarn"):
        raise ValueError(f"rope_parameters.rope_type={kind!r}; accepted for deepseek_v3: 'default', 'yarn'")
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("rope_parameters.partial_rotary_factor != 1 is not supported for deepseek_v3")
    nh = cfg.num_attention_heads
    all_dense = cfg.first_k_dense_replace >= cfg.num_hidden_layers
    moe = {} if all_dense else deepseek_moe.moe_fields_from_hf(cfg)
    extra = {k: getattr(cfg, k) for k in _UNUSED_MOE} if all_dense else {}
    extra[_MTP] = int(cfg.num_mtp_layers or 0)
    return dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=nh, num_query_groups=nh, kv_channels=cfg.v_head_dim, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings, rotary_base=float(rp["rope_theta"]),
        layernorm_epsilon=cfg.rms_norm_eps, tie_word_embeddings=bool(cfg.tie_word_embeddings),
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=cfg.qk_rope_head_dim, mla_rope_interleave=bool(cfg.rope_interleave),
        extra=extra, **moe, **(_yarn(rp, cfg.max_position_embeddings) if kind == "yarn" else {}))


def _to_hf(spec: Any) -> dict[str, Any]:
    if not spec.is_mla:
        raise ValueError("ArchSpec(family='deepseek_v3') without multi-latent attention (kv_lora_rank) has no HF "
                         "DeepSeek-V3 equivalent")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rotary_base}
    if spec.rope_scaling == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": spec.rotary_base, "factor": spec.rope_scaling_factor,
                "original_max_position_embeddings": spec.yarn_original_max_position_embeddings,
                "beta_fast": spec.yarn_beta_fast, "beta_slow": spec.yarn_beta_slow, "mscale": spec.yarn_mscale,
                "mscale_all_dim": spec.yarn_mscale_all_dim}
    return {
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn_hidden_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_attention_heads, "q_lora_rank": spec.q_lora_rank,
        "kv_lora_rank": spec.kv_lora_rank, "qk_nope_head_dim": spec.qk_head_dim,
        "qk_rope_head_dim": spec.qk_pos_emb_head_dim, "v_head_dim": spec.kv_channels,
        "rope_interleave": spec.mla_rope_interleave,
        "hidden_act": "silu", "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.layernorm_epsilon, "rope_theta": spec.rotary_base, "rope_parameters": rope,
        "tie_word_embeddings": spec.tie_word_embeddings, "attention_dropout": 0.0, "use_cache": True,
        "torch_dtype": "float32", _MTP: spec.extra.get(_MTP, 0),
        **({**{k: spec.extra[k] for k in _UNUSED_MOE if k in spec.extra}, "first_k_dense_replace": spec.num_layers}
           if not spec.is_moe else {**deepseek_moe.moe_config_json(spec), **_ROUTER_KEYS}),
        "output_router_logits": False,
        **{k: spec.extra[k] for k in TOKEN_ID_KEYS if k in spec.extra},
    }


# deepseek-ai/DeepSeek-V3 (and DeepSeek-V3-0324, DeepSeek-R1: the same config.json shapes)
_V3 = dict(num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128, num_query_groups=128,
           kv_channels=128, vocab_size=129280, max_position_embeddings=163840, rotary_base=10000.0,
           rope_scaling="yarn", rope_scaling_factor=40.0, yarn_original_max_position_embeddings=4096,
           yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=1.0,
           layernorm_epsilon=1e-6, tie_word_embeddings=False, q_lora_rank=1536, kv_lora_rank=512,
           qk_head_dim=128, qk_pos_emb_head_dim=64, num_moe_experts=256, moe_ffn_hidden_size=2048,
           moe_router_topk=8, moe_norm_topk_prob=True, moe_shared_expert_intermediate_size=2048,
           moe_router_score_function="sigmoid", moe_router_expert_bias=True, moe_router_num_groups=8,
           moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5, moe_first_k_dense=3,
           extra={"bos_token_id": 0, "eos_token_id": 1, _MTP: 1})

FAMILY = ModelFamily(
    name="deepseek_v3",
    display_name="DeepSeek-V3",
    model_types=("deepseek_v3",),
    architectures=("DeepseekV3ForCausalLM",),
    names=FamilyTable("deepseek_v3", llama_style.PRE, MLA_ATTENTION + deepseek_moe.MLP, llama_style.POST),
    from_hf=_from_hf,
    to_hf=_to_hf,
    passthrough=("model.layers.{mtp}.",),  # MTP layers (conversion/passthrough.py)
    moe=True,
    shared_experts=True,
    # MLA with a low-rank query, YaRN (factor 4 over 128 positions, mscale != mscale_all_dim so both the
    # cos/sin concentration and the softmax scale differ from 1), interleaved rotary rows, untied; layer 0
    # dense, layer 1 MoE: 8 experts in 4 groups, top-4 from the best 2 groups (HF's top-2 group score =
    # Megatron's top-(4/2)), scaling 2.5, one shared expert, sigmoid + correction bias.
    tiny=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6, attention_dropout=0.0,
              q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              rope_interleave=True, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
              moe_intermediate_size=32, num_experts_per_tok=4, n_group=4, topk_group=2,
              routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False, **_ROUTER_KEYS,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                               "mscale": 1.0, "mscale_all_dim": 0.5}),
    presets={
        # 671.0 B in the main model (the published "671B"); its one MTP layer (model.layers.61.*, 11.7 B
        # with its own 256 experts, hence the checkpoint's "685B") is passed through and not counted.
        "deepseek-v3": _V3,
    },
    planning_layouts={
        # A small DeepSeek-V3-architecture layout (15.7 B total, 2.4 B active) for planning and bench runs:
        # DeepSeek-V2-Lite's shapes (27 layers, hidden 2048, 16 MLA heads without q_lora, kv_lora 512, 64
        # routed experts of 1408 + 2 shared, top-6, first layer dense) with DeepSeek-V3's router (sigmoid,
        # correction bias, no group limit) and YaRN (factor 8 over 4k). No published checkpoint.
        "deepseek-v3-small": dict(_V3, num_layers=27, hidden_size=2048, ffn_hidden_size=10944,
                                  num_attention_heads=16, num_query_groups=16, vocab_size=102400,
                                  q_lora_rank=None, num_moe_experts=64, moe_ffn_hidden_size=1408, moe_router_topk=6,
                                  moe_shared_expert_intermediate_size=2816, moe_router_num_groups=None,
                                  moe_router_group_topk=None, moe_router_topk_scaling_factor=1.0,
                                  moe_first_k_dense=1, max_position_embeddings=32768,
                                  yarn_original_max_position_embeddings=4096, rope_scaling_factor=8.0),
    },
)

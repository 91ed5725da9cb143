"""Qwen3.5 (dense) and Qwen3.5-MoE text models: hybrid Gated DeltaNet / gated full attention.

Three of every four layers (``layer_types``) are linear attention (``model/gdn.py``), the others
softmax attention with an output gate (``q_proj`` doubled: per head ``[query | gate]``), q/k
RMSNorm and partial rotary (``partial_rotary_factor``, 0.25). Every RMSNorm of the decoder is
zero-centred (``1 + w``); the GDN's own output norm is not. The MoE variant has softmax top-k
experts with normalised top-k probabilities in every layer plus one shared expert scaled by
``sigmoid(shared_expert_gate(x))``.

This module declares the dense family (``qwen3_5_text``, ``Qwen3_5ForCausalLM``) and what the MoE one
(``qwen3_5_moe.py``) shares with it. Presets: the published checkpoints' text configs
(``qwen3_5_presets.py``).
"""

from __future__ import annotations

from typing import Any

from megatron_maspo.model.families import llama_style
from megatron_maspo.model.families.declaration import ModelFamily, SpecFields
from megatron_maspo.model.families.hybrid_names import GatedQKV, GdnConv, GdnInProj
from megatron_maspo.model.families.names import Direct, Entry, FamilyTable
from megatron_maspo.model.families.qwen3_5_presets import DENSE_PRESETS
from megatron_maspo.model.gdn_dims import GdnDims

_L = "model.layers.{layer}."
_M = "decoder.layers.{layer}."
_G = _L + "linear_attn."
_S = _M + "self_attention."

INPUT_NORM = Direct(_L + "input_layernorm.weight", _M + "input_layernorm.weight")
LINEAR: tuple[Entry, ...] = (
    INPUT_NORM,
    GdnInProj(_G + "in_proj_qkv.weight", _G + "in_proj_z.weight", _G + "in_proj_b.weight",
              _G + "in_proj_a.weight", _S + "in_proj.weight"),
    GdnConv(_G + "conv1d.weight", _S + "conv_weight"),
    Direct(_G + "A_log", _S + "A_log", split=0),
    Direct(_G + "dt_bias", _S + "dt_bias", split=0),
    Direct(_G + "norm.weight", _S + "out_norm_weight"),
    Direct(_G + "out_proj.weight", _S + "out_proj.weight", split=1),
)
_A = _L + "self_attn."
FULL: tuple[Entry, ...] = (
    INPUT_NORM,
    GatedQKV(_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight", _S + "linear_qkv.weight"),
    Direct(_A + "q_norm.weight", _S + "q_layernorm.weight"),
    Direct(_A + "k_norm.weight", _S + "k_layernorm.weight"),
    Direct(_A + "o_proj.weight", _S + "linear_proj.weight", split=1),
)
PRE_MLP_NORM = Direct(_L + "post_attention_layernorm.weight", _M + "pre_mlp_layernorm.weight")
KINDS = {"linear_attention": "linear", "full_attention": "full"}


def common_fields(cfg: Any, d: dict) -> SpecFields:
    if getattr(cfg, "attention_bias", False):
        raise ValueError("qwen3_5 with attention_bias=True is not supported")
    kinds = list(cfg.layer_types)
    if set(kinds) - set(KINDS):
        raise ValueError(f"layer_types {sorted(set(kinds) - set(KINDS))} are not supported; "
                         f"accepted: {sorted(KINDS)}")
    rope = dict(d.get("rope_parameters") or {})
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    dims = GdnDims.from_hf(cfg)
    return dict(layer_types=tuple(KINDS[k] for k in kinds), rotary_percent=float(partial),
                attention_output_gate=True, zero_centered_norm=True,
                linear_attention=dict(num_key_heads=dims.num_key_heads, num_value_heads=dims.num_value_heads,
                                      key_head_dim=dims.key_head_dim, value_head_dim=dims.value_head_dim,
                                      conv_kernel=dims.conv_kernel))


def _dense_from_hf(cfg: Any, d: dict) -> SpecFields:
    return dict(llama_style.spec_fields(cfg, d), **common_fields(cfg, d))


def config_json(spec: Any) -> dict[str, Any]:
    if not (spec.attention_output_gate and spec.zero_centered_norm and spec.layer_types):
        raise ValueError(f"ArchSpec(family={spec.family!r}) must have attention_output_gate, "
                         "zero_centered_norm and layer_types: HF Qwen3.5 always has them")
    d = llama_style.config_json(spec)
    la = spec.linear_attention or {}
    names = {v: k for k, v in KINDS.items()}
    d["rope_parameters"]["partial_rotary_factor"] = spec.rotary_percent
    d.update(partial_rotary_factor=spec.rotary_percent, layer_types=[names[k] for k in spec.layer_types],
             linear_num_key_heads=la.get("num_key_heads"), linear_num_value_heads=la.get("num_value_heads"),
             linear_key_head_dim=la.get("key_head_dim"), linear_value_head_dim=la.get("value_head_dim"),
             linear_conv_kernel_dim=la.get("conv_kernel", 4))
    return d


def _dense_to_hf(spec: Any) -> dict[str, Any]:
    return config_json(spec)


def recurrent_state_bytes(spec: Any, bytes_per_element: int) -> int:
    """Decode state of one sequence over all linear layers: the fp32 delta state and the conv window
    at ``bytes_per_element`` (the model dtype)."""
    n_linear = sum(1 for k in spec.layer_types or () if k == "linear")
    if not n_linear:
        return 0
    return n_linear * GdnDims(**spec.linear_attention).decode_state_bytes(bytes_per_element)


TINY = dict(llama_style.TINY_COMMON, num_hidden_layers=4, head_dim=16, tie_word_embeddings=False,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25})
BY_KIND = {"linear": LINEAR, "full": FULL}

FAMILY = ModelFamily(
    name="qwen3_5",
    display_name="Qwen3.5",
    model_types=("qwen3_5_text",),
    architectures=("Qwen3_5ForCausalLM",),
    names=FamilyTable("qwen3_5", llama_style.PRE, (PRE_MLP_NORM, *llama_style.DENSE_MLP), llama_style.POST),
    from_hf=_dense_from_hf,
    to_hf=_dense_to_hf,
    qk_norm=True,
    tiny=TINY,
    presets=DENSE_PRESETS,
    layer_names_by_kind=BY_KIND,
    recurrent_state_bytes=recurrent_state_bytes,
)

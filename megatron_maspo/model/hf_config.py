"""Hugging Face ``config.json`` <-> :class:`ArchSpec` (conversion-rules.md §8).

Only the architectures the conversion tables cover are accepted; anything Megatron-Core cannot
reproduce exactly (sliding windows, non-SiLU MLPs, llama3 rope scaling with parameters other than
the ones megatron-core hard-codes, MoE layers interleaved with dense ones) is refused with a
``ValueError`` naming the field, rather than converted into a silently different model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from megatron_maspo.model.spec import ArchSpec

logger = logging.getLogger(__name__)

# HF model_type -> (ArchSpec.family, CausalLM class name written to ``architectures``).
HF_MODEL_TYPES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
_FAMILY_TO_HF = {fam: (mt, arch) for mt, (fam, arch) in HF_MODEL_TYPES.items()}

# megatron-core 0.16.1 RotaryEmbedding._apply_scaling hard-codes these for rope_scaling=True.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
_EXTRA_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _as_dict(config: Any) -> dict:
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, Path)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"no HF config.json at {path}")
        return json.loads(path.read_text())
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"config must be a transformers PretrainedConfig, a dict or a folder path; "
                    f"got {type(config).__name__}")


def _rope(d: dict) -> tuple[float, str | None, float]:
    """(rope_theta, scaling kind, factor) from ``rope_parameters`` (transformers 5) or the v4 keys."""
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    theta = params.get("rope_theta", d.get("rope_theta"))
    if theta is None:
        raise ValueError("HF config has no rope_theta (neither rope_parameters['rope_theta'] nor rope_theta)")
    scaling = {**legacy, **{k: v for k, v in params.items() if k != "rope_theta"}}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None, 1.0
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return float(theta), "linear", factor
    if kind == "llama3":
        for key, want in MEGATRON_LLAMA3_ROPE.items():
            if float(scaling.get(key, want)) != want:
                raise ValueError(f"llama3 rope scaling with {key}={scaling.get(key)}: megatron-core "
                                 f"hard-codes {key}={want}; this model cannot be reproduced exactly")
        return float(theta), "llama3", factor
    raise ValueError(f"rope_type={kind!r} is not supported; accepted: 'default', 'linear', 'llama3'")


def arch_spec_from_hf(config: Any) -> ArchSpec:
    """Build an :class:`ArchSpec` from an HF config.

    Args:
        config: a transformers ``PretrainedConfig``, its ``to_dict()``, or a folder (or file) holding
            ``config.json``.

    Raises:
        ValueError: unsupported ``model_type``/``architectures`` or a feature Megatron cannot
            reproduce exactly; the message names the field.
    """
    d = _as_dict(config)
    model_type = d.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"HF model_type={model_type!r} is not supported; accepted: {sorted(HF_MODEL_TYPES)}")
    family, arch = HF_MODEL_TYPES[model_type]
    archs = d.get("architectures") or [arch]
    if archs != [arch]:
        raise ValueError(f"HF architectures={archs} is not supported for model_type={model_type!r}; "
                         f"accepted: [{arch!r}]")
    # Fill transformers' own defaults for keys a hand-written dict leaves out.
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in d.items() if k != "model_type"})
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported; accepted: 'silu'")
    if getattr(cfg, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (Megatron add_bias_linear=False)")
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported")
    theta, scaling, factor = _rope(d)
    nh = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    # Qwen2 attention always has q/k/v biases (no config flag); the others follow attention_bias.
    qkv_bias = True if family == "qwen2" else bool(getattr(cfg, "attention_bias", False))
    kw: dict[str, Any] = {}
    if family == "qwen3_moe":
        if getattr(cfg, "decoder_sparse_step", 1) != 1 or list(getattr(cfg, "mlp_only_layers", []) or []):
            raise ValueError("qwen3_moe with decoder_sparse_step != 1 or non-empty mlp_only_layers "
                             "(dense layers among MoE layers) is not supported")
        kw = dict(num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
                  moe_router_topk=cfg.num_experts_per_tok, moe_norm_topk_prob=bool(cfg.norm_topk_prob))
    return ArchSpec(
        family=family,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=nh,
        num_query_groups=getattr(cfg, "num_key_value_heads", None) or nh,
        kv_channels=head_dim,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rotary_base=theta,
        rope_scaling=scaling,
        rope_scaling_factor=factor,
        layernorm_epsilon=cfg.rms_norm_eps,
        add_qkv_bias=qkv_bias,
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        extra={k: d[k] for k in _EXTRA_KEYS if d.get(k) is not None},
        **kw,
    )


def hf_config_dict(spec: ArchSpec) -> dict:
    """``config.json`` content for ``spec``, loadable by ``AutoConfig``/``AutoModelForCausalLM``.

    Writes ``rope_parameters`` (transformers 5) and the legacy ``rope_theta``/``rope_scaling`` keys so
    older readers (vLLM's config loader) see the same rope.
    """
    if spec.moe_shared_expert_intermediate_size:
        raise ValueError("ArchSpec.moe_shared_expert_intermediate_size is set but no supported HF family "
                         "(qwen3_moe) has shared experts")
    model_type, arch = _FAMILY_TO_HF[spec.family]
    rope: dict[str, Any] = {"rope_type": "default"}
    if spec.rope_scaling == "linear":
        rope = {"rope_type": "linear", "factor": spec.rope_scaling_factor}
    elif spec.rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "factor": spec.rope_scaling_factor, **MEGATRON_LLAMA3_ROPE}
    d: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [arch],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_query_groups,
        "head_dim": spec.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.layernorm_epsilon,
        "rope_theta": spec.rotary_base,
        "rope_parameters": {**rope, "rope_theta": spec.rotary_base},
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
        **{k: spec.extra[k] for k in _EXTRA_KEYS if k in spec.extra},
    }
    if spec.rope_scaling:
        d["rope_scaling"] = dict(rope)
    if spec.family == "qwen2":
        if not spec.add_qkv_bias:
            raise ValueError("ArchSpec(family='qwen2').add_qkv_bias=False: HF Qwen2 always has QKV biases")
    else:
        d["attention_bias"] = spec.add_qkv_bias
    if spec.family in ("qwen3", "qwen3_moe") and not spec.qk_layernorm:
        raise ValueError(f"ArchSpec(family={spec.family!r}).qk_layernorm=False: HF Qwen3 always has q/k norms")
    if spec.family in ("llama", "qwen2") and spec.qk_layernorm:
        raise ValueError(f"ArchSpec(family={spec.family!r}).qk_layernorm=True has no HF equivalent")
    if spec.family == "qwen3_moe":
        d.update(num_experts=spec.num_moe_experts, moe_intermediate_size=spec.moe_ffn_hidden_size,
                 num_experts_per_tok=spec.moe_router_topk, norm_topk_prob=spec.moe_norm_topk_prob,
                 decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                 router_aux_loss_coef=0.0)
    elif spec.is_moe:
        raise ValueError(f"ArchSpec(family={spec.family!r}) has num_moe_experts set; only qwen3_moe is MoE")
    return d

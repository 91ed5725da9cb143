"""What the Llama-style decoders (Llama, Qwen2, Qwen3, Qwen3-MoE) share: name-table blocks, the HF config
mapping both ways (conversion-rules.md §8) and the tiny test model's common fields.

HF names are safetensors checkpoint keys (what ``save_pretrained`` writes and vLLM's ``load_weights``
expects), never transformers-5 in-memory names: Qwen3-MoE experts are per-expert here although
transformers fuses them in memory (conversion-rules.md §9). Megatron names are the local spec's; the TE
spec's spellings derive from them (``model/te_names.py``).
"""

from __future__ import annotations

from typing import Any

from megatron_maspo.model.families.declaration import TOKEN_ID_KEYS, SpecFields
from megatron_maspo.model.families.names import QKV, Direct, Entry, GatedMLP

_A = "model.layers.{layer}.self_attn."
_M = "decoder.layers.{layer}."

PRE: tuple[Entry, ...] = (
    Direct("model.embed_tokens.weight", "embedding.word_embeddings.weight", split=0, vocab=True),
)
POST: tuple[Entry, ...] = (
    Direct("model.norm.weight", "decoder.final_layernorm.weight"),
    Direct("lm_head.weight", "output_layer.weight", split=0, vocab=True, when="untied"),
)
ATTENTION: tuple[Entry, ...] = (
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
DENSE_MLP: tuple[Entry, ...] = (
    GatedMLP("model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight",
             _M + "mlp.linear_fc1.weight"),
    Direct("model.layers.{layer}.mlp.down_proj.weight", _M + "mlp.linear_fc2.weight", split=1),
)

TINY_COMMON: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-6, attention_dropout=0.0)
"""The tiny test model's shape (``model/tiny_hf.py``): 2 layers, hidden 64, GQA 4/2."""

# megatron-core 0.16.1 RotaryEmbedding._apply_scaling hard-codes these for rope_scaling=True.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}


def rope_from_hf(d: dict) -> tuple[float, str | None, float]:
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


def spec_fields(cfg: Any, d: dict) -> SpecFields:
    """The shared HF config -> ``ArchSpec`` mapping of a Llama-style decoder (dense MLP fields only).

    Args:
        cfg: the transformers config, its defaults filled.
        d: the raw ``config.json`` dict (rope keys are read from it as written).

    Raises:
        ValueError: a non-SiLU MLP, MLP biases, sliding windows or an unsupported rope, by field name.
    """
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported; accepted: 'silu'")
    if getattr(cfg, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (Megatron add_bias_linear=False)")
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported")
    theta, scaling, factor = rope_from_hf(d)
    nh = cfg.num_attention_heads
    return dict(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=nh,
        num_query_groups=getattr(cfg, "num_key_value_heads", None) or nh,
        kv_channels=getattr(cfg, "head_dim", None) or cfg.hidden_size // nh,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rotary_base=theta,
        rope_scaling=scaling,
        rope_scaling_factor=factor,
        layernorm_epsilon=cfg.rms_norm_eps,
        add_qkv_bias=bool(getattr(cfg, "attention_bias", False)),
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
    )


def config_json(spec: Any) -> dict[str, Any]:
    """The shared ``config.json`` body of a Llama-style decoder for ``spec`` (an ``ArchSpec``).

    Writes ``rope_parameters`` (transformers 5) and the legacy ``rope_theta``/``rope_scaling`` keys so
    older readers (vLLM's config loader) see the same rope.
    """
    rope: dict[str, Any] = {"rope_type": "default"}
    if spec.rope_scaling == "linear":
        rope = {"rope_type": "linear", "factor": spec.rope_scaling_factor}
    elif spec.rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "factor": spec.rope_scaling_factor, **MEGATRON_LLAMA3_ROPE}
    d: dict[str, Any] = {
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
        **{k: spec.extra[k] for k in TOKEN_ID_KEYS if k in spec.extra},
    }
    if spec.rope_scaling:
        d["rope_scaling"] = dict(rope)
    return d

"""Qwen3.5 family declaration: HF config -> ArchSpec -> config.json reloads in transformers with the
same effective fields; parameter counts equal the transformers models'; the per-sequence recurrent
state the planner uses; configs the family cannot reproduce are refused."""

from __future__ import annotations

import pytest

from megatron_maspo.model.hf_config import arch_spec_from_hf, hf_config_dict
from megatron_maspo.model.tiny_hf import make_tiny_hf_model

FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
          "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps",
          "vocab_size", "tie_word_embeddings", "attention_bias")
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_config_round_trip_and_parameter_count(family):
    from transformers import AutoConfig

    model, cfg = make_tiny_hf_model(family)
    spec = arch_spec_from_hf(cfg)
    assert spec.is_hybrid and spec.layer_types == ("linear", "linear", "linear", "full")
    assert spec.rotary_percent == 0.25 and spec.attention_output_gate and spec.zero_centered_norm
    d = hf_config_dict(spec)
    back = AutoConfig.for_model(d.pop("model_type"), **d)
    for f in FIELDS + (MOE_FIELDS if family.endswith("moe") else ()):
        assert getattr(back, f) == getattr(cfg, f), f
    for key in ("rope_theta", "partial_rotary_factor"):  # transformers >= 5.22 keeps them in rope_parameters only
        assert back.rope_parameters[key] == cfg.rope_parameters[key], key
    assert arch_spec_from_hf(back) == spec
    assert spec.num_parameters() == sum(p.numel() for p in model.parameters())


def test_recurrent_state_bytes():
    from megatron_maspo.model.families.registry import get_family

    spec = arch_spec_from_hf(make_tiny_hf_model("qwen3_5")[1])
    # 3 linear layers x (4 heads x 16 x 16 fp32 state + (2·32 + 64) conv channels x 3 bf16 taps)
    assert get_family("qwen3_5").recurrent_state_bytes(spec, 2) == 3 * (4 * 16 * 16 * 4 + 128 * 3 * 2)


def test_unsupported_configs_are_refused():
    from transformers import AutoConfig

    cfg = make_tiny_hf_model("qwen3_5")[1].to_dict()
    with pytest.raises(ValueError, match="attention_bias=True"):
        arch_spec_from_hf(dict(cfg, attention_bias=True))
    bad = dict(cfg, layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"])
    with pytest.raises(ValueError, match="sliding_attention"):
        arch_spec_from_hf(bad)
    assert AutoConfig  # transformers importable (the family reads its config classes)

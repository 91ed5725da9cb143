"""DeepSeek-V3 config mapping: MLA and YaRN fields both ways, rotary-row reorder, and what is refused."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_maspo.conversion.shard import rope_rows_to_hf, rope_rows_to_megatron
from megatron_maspo.model.hf_config import arch_spec_from_hf, hf_config_dict
from megatron_maspo.model.tiny_hf import TINY_DEFAULTS


def _config(**patch) -> dict:
    d = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 301,
         "bos_token_id": 0, "eos_token_id": 1, **TINY_DEFAULTS["deepseek_v3"]}
    d.update(patch)
    return d


def test_mla_and_yarn_fields_from_hf():
    spec = arch_spec_from_hf(_config())
    assert spec.is_mla and spec.is_moe and spec.moe_first_k_dense == 1
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_head_dim, spec.qk_pos_emb_head_dim, spec.kv_channels) \
        == (48, 32, 16, 8, 16)
    assert spec.num_query_groups == spec.num_attention_heads == 4 and spec.mla_rope_interleave
    assert (spec.rope_scaling, spec.rope_scaling_factor, spec.yarn_original_max_position_embeddings) == ("yarn", 4.0, 128)
    assert (spec.yarn_mscale, spec.yarn_mscale_all_dim, spec.yarn_beta_fast, spec.yarn_beta_slow) == (1.0, 0.5, 32, 1)
    assert spec.extra["num_nextn_predict_layers"] == 1
    assert (spec.moe_router_num_groups, spec.moe_router_group_topk, spec.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    dense = arch_spec_from_hf(_config(first_k_dense_replace=2))
    assert not dense.is_moe and dense.extra["n_routed_experts"] == 8  # unused, carried for the export


def test_yarn_mscale_without_mscale_all_dim_is_the_plain_concentration():
    """transformers: mscale without mscale_all_dim means the plain m(factor, 1) concentration (and softmax
    scale 1/sqrt(d)), which megatron-core computes from mscale=1, mscale_all_dim=0."""
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 128,
            "mscale": 0.7}
    spec = arch_spec_from_hf(_config(rope_parameters=rope))
    assert spec.rope_scaling_factor == 4.0 and (spec.yarn_mscale, spec.yarn_mscale_all_dim) == (1.0, 0.0)


def test_hf_config_round_trip_keeps_every_field_that_changes_the_maths():
    import transformers

    for patch in ({}, {"q_lora_rank": None}, {"rope_interleave": False}, {"first_k_dense_replace": 2},
                  {"rope_parameters": {"rope_type": "default", "rope_theta": 5e4}}):
        spec = arch_spec_from_hf(_config(**patch))
        out = hf_config_dict(spec)
        cfg = transformers.AutoConfig.for_model(**out)
        assert arch_spec_from_hf(cfg) == spec
        src = transformers.AutoConfig.for_model(**_config(**patch))
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "rope_interleave", "first_k_dense_replace", "num_mtp_layers", "rms_norm_eps",
                    "num_key_value_heads", "n_routed_experts", "routed_scaling_factor"):
            assert getattr(cfg, key) == getattr(src, key), key
        assert {k: v for k, v in cfg.rope_parameters.items() if v is not None} == \
            {k: v for k, v in src.rope_parameters.items() if v is not None}


@pytest.mark.parametrize("patch,match", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "block-FP8"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 128, "mscale_all_dim": 1.0}}, "without mscale"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 128, "attention_factor": 2.0}}, "attention_factor"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}}, "rope_type='linear'"),
    ({"scoring_func": "softmax"}, "scoring_func"),  # vLLM would route by softmax, the trainer by sigmoid
    ({"topk_method": "greedy"}, "topk_method"),
])
def test_unsupported_deepseek_configs_are_refused(patch, match):
    with pytest.raises(ValueError, match=match):
        arch_spec_from_hf(_config(**patch))


def test_export_names_the_router_vllm_must_run():
    """vLLM's DeepSeek module builds the correction bias only for topk_method='noaux_tc' and routes by
    scoring_func: the exported config.json states both (a MoE export only)."""
    d = hf_config_dict(arch_spec_from_hf(_config()))
    assert (d["scoring_func"], d["topk_method"]) == ("sigmoid", "noaux_tc")
    without = {k: v for k, v in _config().items() if k not in ("scoring_func", "topk_method")}
    assert arch_spec_from_hf(without).is_moe  # configs that omit them mean the same router


def test_mla_layout_constraints_name_the_field():
    spec = arch_spec_from_hf(_config(q_lora_rank=45))
    with pytest.raises(ValueError, match="q_lora_rank=45"):
        spec.validate_layout(2, 1)
    spec.validate_layout(1, 2)


def test_rope_row_reorder_matches_megatron_deinterleave():
    """After the reorder, megatron-core's MLA de-interleave (x[0::2] ; x[1::2]) gives back each head's HF
    rotate-half rows; the non-rotary rows never move; the inverse restores the tensor bit for bit."""
    nope, rope, heads = 3, 4, 2
    t = torch.randn(heads * (nope + rope), 5)
    m = rope_rows_to_megatron(t, nope + rope, rope)
    for h in range(heads):
        blk, src = m[h * 7:(h + 1) * 7], t[h * 7:(h + 1) * 7]
        assert torch.equal(blk[:nope], src[:nope])
        x = blk[nope:]
        assert torch.equal(torch.cat([x[0::2], x[1::2]]), src[nope:])
    assert torch.equal(rope_rows_to_hf(m, nope + rope, rope), t)


def test_num_parameters_counts_mla_blocks():
    spec = arch_spec_from_hf(_config())
    import transformers

    model = transformers.DeepseekV3ForCausalLM(transformers.AutoConfig.for_model(**_config()))
    # the HF checkpoint's tensors: parameters and the persistent correction-bias buffers
    assert spec.num_parameters() == sum(t.numel() for t in model.state_dict().values())
    json.dumps(hf_config_dict(spec))  # plain JSON


def test_mtp_layers_are_passed_through_by_name(tmp_path):
    """Keys of the MTP layers (``model.layers.{L}...``) pass the key check and are kept by name, bytes unchanged."""
    from megatron_maspo.conversion.hf_to_megatron import HFSource, check_hf_keys
    from megatron_maspo.conversion.passthrough import (
        load_passthrough,
        passthrough_keys,
        save_passthrough,
    )
    from megatron_maspo.conversion.plan import hf_shape, hf_state_dict_keys
    from megatron_maspo.errors import InputError

    spec = arch_spec_from_hf(_config())
    sd = {k: torch.zeros(hf_shape(k, spec)) for k in hf_state_dict_keys(spec)}
    mtp = {"model.layers.2.eh_proj.weight": torch.randn(64, 128), "model.layers.2.enorm.weight": torch.ones(64)}
    check_hf_keys(HFSource({**sd, **mtp}), spec)
    assert passthrough_keys(spec, [*sd, *mtp]) == sorted(mtp)
    with pytest.raises(InputError, match="model.norm_extra.weight"):
        check_hf_keys(HFSource({**sd, **mtp, "model.norm_extra.weight": torch.ones(64)}), spec)
    save_passthrough(mtp, tmp_path)
    back = dict(load_passthrough(tmp_path))
    assert set(back) == set(mtp) and all(torch.equal(back[k], v) for k, v in mtp.items())

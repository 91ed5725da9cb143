"""Name tables vs real checkpoints: HF keys vs ``save_pretrained`` and HF config round-trips.

The Megatron side of the tables is checked against real ``GPTModel.named_parameters()`` at every
layout in tests/distributed/test_conversion_parity.py (``load_hf_weights`` refuses any parameter
the table does not cover and any table name the model lacks)."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from megatron_maspo.conversion import hf_state_dict_keys
from megatron_maspo.conversion.plan import hf_shape
from megatron_maspo.model.hf_config import arch_spec_from_hf, hf_config_dict
from megatron_maspo.model.tiny_hf import make_tiny_hf_model

FAMILIES = ["qwen2", "llama", "qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for fam in FAMILIES:
        d = tmp_path_factory.mktemp(fam)
        make_tiny_hf_model(fam, d, vocab_size=301)
        out[fam] = d
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_keys_and_shapes_equal_save_pretrained(saved, family):
    spec = arch_spec_from_hf(saved[family])
    with safe_open(str(saved[family] / "model.safetensors"), framework="pt") as f:
        on_disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    keys = hf_state_dict_keys(spec)
    assert len(keys) == len(set(keys)) and set(keys) == set(on_disk)
    assert all(hf_shape(k, spec) == on_disk[k] for k in keys)
    assert ("lm_head.weight" in on_disk) == (not spec.tie_word_embeddings)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trip_loads_in_transformers(saved, family):
    import transformers

    spec = arch_spec_from_hf(saved[family])
    d = hf_config_dict(spec)
    assert arch_spec_from_hf(d) == spec
    cfg = transformers.AutoConfig.for_model(**d)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert type(model).__name__ == d["architectures"][0]
    assert arch_spec_from_hf(cfg) == spec
    assert arch_spec_from_hf(json.loads((saved[family] / "config.json").read_text())) == spec


def test_spec_fields_from_hf(saved):
    llama = arch_spec_from_hf(saved["llama"])
    assert (llama.rope_scaling, llama.rope_scaling_factor, llama.rotary_base) == ("llama3", 8.0, 5e5)
    assert arch_spec_from_hf(saved["qwen2"]).add_qkv_bias
    q3 = arch_spec_from_hf(saved["qwen3"])
    assert q3.qk_layernorm and q3.kv_channels == 32 and q3.tie_word_embeddings
    moe = arch_spec_from_hf(saved["qwen3_moe"])
    assert (moe.num_moe_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (4, 2, 32)


@pytest.mark.parametrize("patch,match", [
    ({"model_type": "mistral"}, "model_type='mistral'"),
    ({"architectures": ["Qwen2Model"]}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type='yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                          "rope_theta": 5e5}}, "low_freq_factor"),
])
def test_unsupported_configs_are_refused(saved, patch, match):
    d = json.loads((saved["llama"] / "config.json").read_text())
    d.update(patch)
    with pytest.raises(ValueError, match=match):
        arch_spec_from_hf(d)


def test_gqa_tp_greater_than_kv_heads_is_refused(saved):
    """Megatron-Core needs num_query_groups % tp == 0: TP4 with 2 KV heads must be refused clearly."""
    spec = arch_spec_from_hf(saved["qwen2"])
    with pytest.raises(ValueError, match="num_query_groups=2 < tensor_model_parallel_size=4"):
        spec.validate_layout(4, 1)
    with pytest.raises(ValueError, match="num_layers=2 is not divisible"):
        spec.validate_layout(1, 4)

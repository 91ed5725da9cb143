"""The family registry: one module declares each family, and every family list is a view of the registry.

A dummy family (transformers' Mistral classes, whose checkpoint keys are Llama's, declared with the
Llama-style mapping; not a supported Mistral: sliding windows are not modelled) is registered, seen by
every derived list and by the functions reading them, then unregistered.
"""

from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import pytest
from safetensors import safe_open

from megatron_maspo.cli.convert import TINY_FAMILIES
from megatron_maspo.cli.main import main
from megatron_maspo.conversion import hf_state_dict_keys
from megatron_maspo.conversion.families import FAMILY_TABLES, family_table
from megatron_maspo.model.families import llama_style
from megatron_maspo.model.families.declaration import FusedExperts, LayerKind, ModelFamily, Nesting
from megatron_maspo.model.families.names import FamilyTable
from megatron_maspo.model.families.registry import (
    BUILT_IN,
    families,
    get_family,
    register,
    unregister,
)
from megatron_maspo.model.hf_config import HF_MODEL_TYPES, arch_spec_from_hf, hf_config_dict
from megatron_maspo.model.presets import PLANNING_LAYOUTS, PRESETS, get_preset
from megatron_maspo.model.spec import SUPPORTED_FAMILIES, ArchSpec
from megatron_maspo.model.tiny_hf import TINY_DEFAULTS

_SHAPE = dict(num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_query_groups=2,
              kv_channels=32, vocab_size=1000)


def _dummy(name: str = "dummy", model_type: str = "mistral", **kw) -> ModelFamily:
    fields = dict(
        name=name, display_name="Dummy", model_types=(model_type,), architectures=("MistralForCausalLM",),
        names=FamilyTable(name, llama_style.PRE, llama_style.ATTENTION + llama_style.DENSE_MLP, llama_style.POST),
        from_hf=llama_style.spec_fields, to_hf=llama_style.config_json,
        tiny=dict(llama_style.TINY_COMMON, head_dim=16, sliding_window=None, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        presets={"dummy-1b": dict(_SHAPE, rotary_base=1e4)},
        planning_layouts={"dummy-wide": dict(_SHAPE, hidden_size=512, rotary_base=1e4)})
    return ModelFamily(**{**fields, **kw})


@pytest.fixture
def dummy():
    family = register(_dummy())
    try:
        yield family
    finally:
        unregister(family.name)


def _derived_lists():
    return {"SUPPORTED_FAMILIES": sorted(SUPPORTED_FAMILIES), "FAMILY_TABLES": sorted(FAMILY_TABLES),
            "HF_MODEL_TYPES": sorted(v[0] for v in HF_MODEL_TYPES.values()), "TINY_DEFAULTS": sorted(TINY_DEFAULTS),
            "TINY_FAMILIES": sorted(TINY_FAMILIES)}


def test_every_built_in_family_is_declared_in_its_own_module():
    built_in = ["llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3_5", "qwen3_5_moe"]
    assert [f.name for f in families()] == built_in
    for f in BUILT_IN:
        assert importlib.import_module(f"megatron_maspo.model.families.{f.name}").FAMILY is f
    assert tuple(built_in) == SUPPORTED_FAMILIES
    assert all(v == sorted(built_in) for v in _derived_lists().values())


def test_a_registered_family_appears_in_every_derived_list(dummy):
    for where, names in _derived_lists().items():
        assert "dummy" in names, where
    assert HF_MODEL_TYPES["mistral"] == ("dummy", "MistralForCausalLM")
    assert get_preset("DUMMY-1B").family == "dummy" and "dummy-1b" in PRESETS
    assert "dummy-wide" in PLANNING_LAYOUTS and get_preset("dummy-wide").hidden_size == 512
    spec = ArchSpec(family="dummy", **_SHAPE)
    assert family_table(spec) is dummy.names
    assert len(hf_state_dict_keys(spec)) == 2 + 1 + 4 * 9  # embedding, norm, head; 9 tensors per layer


def test_unregistering_removes_it_everywhere():
    register(_dummy())
    unregister("dummy")
    for where, names in _derived_lists().items():
        assert "dummy" not in names, where
    with pytest.raises(ValueError, match="ArchSpec.family='dummy' is not supported"):
        ArchSpec(family="dummy", **_SHAPE)
    with pytest.raises(ValueError, match="model_type='mistral'"):
        arch_spec_from_hf({"model_type": "mistral"})
    with pytest.raises(ValueError, match="is not a known preset"):
        get_preset("dummy-1b")


def test_a_registered_family_converts_through_the_shared_entry_points(dummy, tmp_path):
    """``maspo convert tiny-hf`` writes it; the config mapping and the name table match the saved folder."""
    out = tmp_path / "dummy"
    assert main(["convert", "tiny-hf", "--family", "dummy", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "mistral"
    spec = arch_spec_from_hf(out)
    assert (spec.family, spec.kv_channels, spec.add_qkv_bias, spec.qk_layernorm) == ("dummy", 16, False, False)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(hf_state_dict_keys(spec)) == set(f.keys())
    assert arch_spec_from_hf(hf_config_dict(spec)) == spec


@pytest.mark.parametrize("change,match", [
    (dict(name="qwen2"), "name 'qwen2'"),
    (dict(model_type="qwen3"), "model_type 'qwen3' \\(family 'qwen3'\\)"),
    (dict(presets={"qwen2.5-7b": {}}), "preset 'qwen2.5-7b' \\(family 'qwen2'\\)"),
    (dict(presets={"Dummy-1B": {}}), "lower case"),
    (dict(model_types=()), "no model_types"),
])
def test_clashes_are_refused_and_leave_the_registry_unchanged(change, match):
    name, model_type = change.pop("name", "dummy"), change.pop("model_type", "mistral")
    before = families()
    family = _dummy(name, model_type, **change)
    with pytest.raises(ValueError, match=match):
        register(family)
    assert families() == before


def test_the_declaration_expresses_the_next_families():
    """Qwen3.5-style: a multimodal wrapper, hybrid linear/full attention, fused experts, MTP and vision
    passed through, recurrent state per sequence. Fields only: nothing reads them yet."""
    def kinds(cfg):
        return tuple(LayerKind(attention="linear" if t == "linear_attention" else "full", mlp="moe")
                     for t in cfg.text_config["layer_types"])

    family = _dummy("hybrid", "hybrid_test", layer_kinds=kinds, nesting=Nesting(),
                    layer_names_by_kind={"linear": (), "moe": ()},
                    fused_experts=FusedExperts("model.layers.{layer}.mlp.experts.gate_up_proj",
                                               "model.layers.{layer}.mlp.experts.down_proj"),
                    passthrough=("mtp.", "model.visual."), recurrent_state_bytes=lambda spec, nbytes: 0)
    cfg = SimpleNamespace(text_config={"layer_types": ["linear_attention"] * 3 + ["full_attention"]})
    assert [k.attention for k in family.layer_kinds(cfg)] == ["linear"] * 3 + ["full"]
    assert family.nesting.hf_prefix == "model.language_model." and family.nesting.config_key == "text_config"
    defaults = get_family("qwen3_moe")
    assert (defaults.layer_kinds, defaults.nesting, defaults.fused_experts, defaults.passthrough,
            defaults.recurrent_state_bytes, dict(defaults.layer_names_by_kind)) == (None, None, None, (), None, {})


def test_every_family_with_a_tiny_model_has_its_conversion_tests():
    """Adding a family means adding it to the parametrised conversion tests (docs/conversion.md)."""
    from tests.distributed import test_conversion_parity
    from tests.unit.conversion import test_keys_and_config

    assert sorted(test_keys_and_config.FAMILIES) == sorted(TINY_DEFAULTS)
    assert sorted(test_conversion_parity.FAMILIES) == sorted(test_conversion_parity.DEFAULT) == sorted(TINY_DEFAULTS)

"""The recorded Transformer Engine spec names: checked against the installed megatron-core source text (an
upgrade that renames breaks here), and resolved by the conversion tables in both directions for dense and
MoE layers, grouped GEMM (``linear_fc1.weight{j}``) included."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from megatron_maspo.conversion.plan import global_items, mcore_names, resolve
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.model.te_names import (
    MEGATRON_CORE_VERSIONS,
    SOURCES,
    VERSION_SOURCES,
    local_name,
    spellings,
    te_name,
)

MOE = ArchSpec(family="qwen3_moe", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
               num_query_groups=2, kv_channels=16, vocab_size=100, max_position_embeddings=64, qk_layernorm=True,
               num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2)
DENSE = ArchSpec(family="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, kv_channels=16, vocab_size=100, max_position_embeddings=64, add_qkv_bias=True)


def _core_dir() -> Path:
    return Path(importlib.util.find_spec("megatron.core").submodule_search_locations[0])


def _installed() -> str:
    from megatron_maspo.model.mcore_compat import megatron_core_version

    return megatron_core_version()  # without 0.19's "+<git head>" label


def test_recorded_version_is_the_installed_one():
    assert _installed() in MEGATRON_CORE_VERSIONS, f"megatron-core {_installed()}: re-record model/te_names.py"
    assert set(VERSION_SOURCES) == {v.rsplit(".", 1)[0] for v in MEGATRON_CORE_VERSIONS}


@pytest.mark.parametrize("path,text", SOURCES, ids=[f"{p}:{t[:30]}" for p, t in SOURCES])
def test_every_recorded_fact_is_in_the_installed_source(path, text):
    src = (_core_dir() / path).read_text()
    assert text in src, f"megatron-core {path} no longer contains {text!r}: re-record model/te_names.py"


def test_the_installed_releases_own_facts_are_in_its_source():
    facts = VERSION_SOURCES.get(_installed().rsplit(".", 1)[0])
    assert facts, f"no facts recorded for megatron-core {_installed()}"
    for path, text in facts:
        assert text in (_core_dir() / path).read_text(), f"megatron-core {_installed()} {path}: {text!r} missing"


def _local_names(spec: ArchSpec) -> list[str]:
    out = []
    for item in global_items(spec):
        out += [n for n, _ in mcore_names(item, item.layer, spec, 1, 0)]
    return out


@pytest.mark.parametrize("spec,grouped", [(DENSE, False), (MOE, False), (MOE, True)], ids=["dense", "moe", "moe-grouped"])
def test_tables_resolve_te_names_both_ways(spec, grouped):
    local = _local_names(spec)
    te = {te_name(n, moe_layer=spec.is_moe, grouped_gemm=grouped): n for n in local}
    assert len(te) == len(local)  # the renaming is one-to-one
    params = dict.fromkeys(te)
    for te_n, loc in te.items():
        assert resolve(params, loc) == te_n  # table name -> the TE chunk's parameter
        assert local_name(te_n) == loc  # TE parameter -> the table's name
    if grouped:
        assert "decoder.layers.1.mlp.experts.linear_fc1.weight3" in te
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in te  # MoE layers keep a separate TENorm
    if not spec.is_moe:
        assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te


def test_spellings_cover_local_te_and_grouped():
    n = "decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight"
    assert spellings(n) == (n, "decoder.layers.3.mlp.experts.linear_fc2.weight7")
    with pytest.raises(ValueError, match="any of its spellings"):
        resolve({}, n)

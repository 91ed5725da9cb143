"""Qwen3.5 presets: each is named by the lower-case HF name, counts within 2% of the size in its name
(the published total; the text model without the vision tower), equals transformers' count for the
same config, and the KV/recurrent split the planner uses."""

from __future__ import annotations

import re

import pytest

from megatron_maspo.model.presets import PRESETS, get_preset

QWEN35 = sorted(n for n in PRESETS if n.startswith("qwen3.5-"))


def test_published_sizes_have_presets():
    assert QWEN35 == ["qwen3.5-122b-a10b", "qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3.5-397b-a17b", "qwen3.5-9b"]


@pytest.mark.parametrize("name", QWEN35)
def test_within_two_percent_of_the_published_size(name):
    published = float(re.match(r"qwen3\.5-([\d.]+)b", name).group(1)) * 1e9
    got = get_preset(name).num_parameters()
    assert abs(got - published) / published < 0.02, (name, got)


@pytest.mark.parametrize("name", ["qwen3.5-27b", "qwen3.5-35b-a3b"])
def test_transformers_counts_the_same(name):
    import torch
    import transformers

    from megatron_maspo.model.hf_config import hf_config_dict

    spec = get_preset(name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config_dict(spec)))
    assert sum(p.numel() for p in model.parameters()) == spec.num_parameters()


def test_planner_cache_sizes():
    from megatron_maspo.launch.plan.model import cache_bytes_per_sequence, kv_bytes_per_token

    spec = get_preset("qwen3.5-27b")
    # bf16 K and V of the 16 full-attention layers only: 4 KV heads x 256
    assert kv_bytes_per_token(spec, 1) == 2 * 16 * 4 * 256 * 2
    # 48 GDN layers: 48 heads x 128 x 128 fp32 state + (2·16·128 + 48·128) channels x 3 bf16 conv taps
    state = 48 * (48 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) * 3 * 2)
    assert cache_bytes_per_sequence(spec, 1, 0) == state
    assert abs(48 * 48 * 128 * 128 * 4 / 1e6 - 151.0) < 0.1  # the ~151 MB per in-flight sequence of the issue
    assert cache_bytes_per_sequence(spec, 2, 1000) == 1000 * kv_bytes_per_token(spec, 2) + state / 2

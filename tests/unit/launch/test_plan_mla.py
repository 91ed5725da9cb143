"""Planner figures for multi-latent attention and dense first layers (DeepSeek-V3)."""

from __future__ import annotations

import dataclasses

from megatron_maspo.launch.plan.model import kv_bytes_per_token, local_params
from megatron_maspo.launch.plan.types import Layout
from megatron_maspo.model.presets import get_preset


def test_mla_kv_cache_is_the_compressed_latent_on_every_engine_rank():
    spec = get_preset("deepseek-v3")
    per_token = 61 * (512 + 64) * 2  # (d_c + d_h^R) bf16 elements per layer (DeepSeek-V2 paper, Table 1)
    assert kv_bytes_per_token(spec, 1) == kv_bytes_per_token(spec, 8) == per_token
    # what standard attention with the same heads would cache: 128 heads x (192-wide K + 128-wide V)
    assert per_token * 50 < 2 * 61 * 128 * (192 + 128)


def test_one_rank_holds_the_whole_model_at_one_gpu_and_the_experts_split_over_ep():
    spec = get_preset("deepseek-v3")
    dense, expert = local_params(spec, Layout(tp=1, pp=1, ep=1), divisible_by=1)
    biases = spec.num_moe_layers * spec.num_moe_experts  # fp32 correction biases: not modelled as parameters
    assert dense + expert == spec.num_parameters() - biases
    dense64, expert64 = local_params(spec, Layout(tp=1, pp=1, ep=64), divisible_by=1)
    assert dense64 == dense and expert64 * 64 == expert
    assert expert == 58 * 256 * 3 * 7168 * 2048  # first_k_dense_replace = 3 of 61 layers are dense


def test_dense_first_layers_sit_on_the_first_stage():
    spec = dataclasses.replace(get_preset("deepseek-v3"), num_layers=60)  # 60 layers: PP 2 splits them
    _, expert_pp2 = local_params(spec, Layout(tp=1, pp=2, ep=1))
    assert expert_pp2 == 30 * 256 * 3 * 7168 * 2048  # the last stage: 30 MoE layers, the worst one

"""FP8 rollout weights, the GPU a recipe is sized for, and in-flight updates in the planner."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_maspo.launch.plan import arch_of, estimate, layout_of
from megatron_maspo.launch.plan.model import (
    engine_expert_bytes,
    engine_unquantised_params,
    engine_weight_bytes,
)
from megatron_maspo.launch.plan.rollout import EngineLoad, generation_seconds
from megatron_maspo.launch.plan.types import GPU_FIGURES, gpu_assumptions
from megatron_maspo.model.presets import get_preset
from megatron_maspo.parallel.config import GPU_TYPES, ParallelConfig
from megatron_maspo.recipes.registry import load_recipe


def test_fp8_engine_weights_are_one_byte_per_linear_weight():
    spec = get_preset("deepseek-v3")
    p = spec.num_parameters()
    kept = engine_unquantised_params(spec)
    # embedding and untied head (2 x 129,280 x 7,168) + 58 routers (7,168 x 256) + 123 norms of 7,168
    assert kept == 2 * 129280 * 7168 + 58 * 7168 * 256 + 123 * 7168
    assert engine_weight_bytes(spec, 8) == 2 * p / 8
    assert engine_weight_bytes(spec, 8, "fp8") == pytest.approx((p + kept) / 8)
    assert 0.50 < engine_weight_bytes(spec, 8, "fp8") / engine_weight_bytes(spec, 8) < 0.51


def test_engine_expert_bytes_count_moe_layers_only():
    spec = get_preset("deepseek-v3")  # 3 dense first layers of 61
    per_layer = 256 * 3 * 7168 * 2048
    assert engine_expert_bytes(spec, 8) == 2 * 58 * per_layer / 8
    assert engine_expert_bytes(spec, 8, "fp8") == 58 * per_layer / 8
    assert engine_expert_bytes(get_preset("llama3-70b"), 8) == 0.0


def test_gpu_figures_and_the_config_key_agree():
    assert set(GPU_FIGURES) == set(GPU_TYPES)
    h200 = gpu_assumptions("h200", mfu=0.3)
    assert (h200.gpu_mem_gb, h200.hbm_tb_s, h200.mfu) == (139.0, 4.8, 0.3)
    assert gpu_assumptions("h100").gpu_mem_gb == 80.0
    with pytest.raises(ValueError, match="unknown GPU 'a100'"):
        gpu_assumptions("a100")
    with pytest.raises(ValueError, match="parallel.gpu='a100'"):
        ParallelConfig(gpu="a100")


def _plan(cfg, nodes, **rollout):
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, **rollout))
    return estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=nodes, gpus_per_node=8,
                    hw=gpu_assumptions(cfg.parallel.gpu))


def test_deepseek_v3_fits_only_with_fp8_engines_on_h200():
    """The 671B recipe: bf16 engine weights at TP 8 are 157 GiB per GPU, more than an H200; FP8 fits."""
    cfg = load_recipe("deepseek_v3_maspo")
    fp8 = _plan(cfg, 64)
    assert fp8.fits, fp8.reasons
    assert 78 < fp8.memory.engine_weights < 79 and fp8.memory.peak <= 139
    bf16 = _plan(cfg, 64, vllm_quantization=None)
    assert not bf16.fits and bf16.memory.engine_weights > 139
    h100 = estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=64, gpus_per_node=8, hw=gpu_assumptions("h100"))
    assert not h100.fits  # 84 GB of FP8 weights per GPU: an H100 node cannot hold the engine


def test_fp8_engine_halves_the_weight_reads_of_decode():
    cfg = load_recipe("qwen3_235b_a22b_maspo")
    fp8, bf16 = _plan(cfg, 32), _plan(cfg, 32, vllm_quantization=None, vllm_gpu_memory_utilization=0.9)
    assert fp8.time.generation < bf16.time.generation


def test_in_flight_updates_drop_only_the_straggler_steps():
    load = EngineLoad(seqs=64, conc=64, prompt=500, mean=2000, tail=8000, weight_bytes_full=1e10,
                      weight_bytes_tail=5e9, kv_token_bytes=7e4, active_params=3.7e10, vllm_tp=8)
    kw = dict(hbm_tb_s=4.8, decode_eff=0.45, peak_tflops=989, mfu=0.35, step_fixed_s=2e-3)
    waits, overlaps = generation_seconds(load, **kw), generation_seconds(load, tail_overlapped=True, **kw)
    straggler_steps = (8000 - 2000) * (2e-3 + 5e9 / (4.8e12 * 0.45))
    assert waits - overlaps == pytest.approx(straggler_steps)
    flat = dataclasses.replace(load, tail=2000)
    assert generation_seconds(flat, **kw) == generation_seconds(flat, tail_overlapped=True, **kw)


def test_fp8_training_is_noted_and_estimated_as_bf16():
    """FP8 training is not modelled: a config that asks for it (Megatron's ``fp8`` on the model section; the
    schema has no such key yet, so the attribute is set on the object) is planned as bf16 with one note
    and no other reason, colocated and disaggregated, and ``format_plan`` prints the note."""
    from megatron_maspo.launch.plan import estimate_disaggregated, format_plan
    from megatron_maspo.launch.plan.estimator import FP8_TRAINING_NOTE
    from megatron_maspo.launch.plan.report import format_pool_plan

    bf16 = load_recipe("qwen3_30b_a3b_maspo")
    base = estimate(bf16, arch_of(bf16), layout_of(bf16), nodes=4, gpus_per_node=8)
    assert base.notes == [] and FP8_TRAINING_NOTE == "FP8 training is not modelled; estimated as bf16"
    for bf16_flag in (True, False):  # an FP8 request without bf16 is still estimated as bf16
        cfg = load_recipe("qwen3_30b_a3b_maspo")
        cfg.model.fp8 = "hybrid"
        cfg.model.bf16 = bf16_flag
        plan = estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8)
        assert plan.notes == [FP8_TRAINING_NOTE] and plan.reasons == base.reasons
        assert plan.memory == base.memory
        assert f"  note: {FP8_TRAINING_NOTE}\n" in format_plan(plan)
    cfg.rollout = dataclasses.replace(cfg.rollout, placement="disaggregated", engine_ranks=8, max_staleness=1)
    pool = estimate_disaggregated(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8)
    assert pool.notes == [FP8_TRAINING_NOTE] and f"note: {FP8_TRAINING_NOTE}" in format_pool_plan(pool)

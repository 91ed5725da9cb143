"""Rollout settings that depend on the machine are absolute sizes, validated up front."""

from __future__ import annotations

import pytest

from megatron_maspo.config import MaspoConfig
from megatron_maspo.overrides import apply_overrides
from megatron_maspo.rollout.config import RolloutConfig


def test_cpu_kv_cache_is_a_size_not_a_fraction():
    assert RolloutConfig().vllm_cpu_kv_cache_mb == 512
    with pytest.raises(ValueError, match="vllm_cpu_kv_cache_mb"):
        RolloutConfig(vllm_cpu_kv_cache_mb=0)


def test_cpu_kv_cache_override_from_the_command_line():
    cfg = apply_overrides(MaspoConfig(), ["rollout.vllm_cpu_kv_cache_mb=256"])
    assert cfg.rollout.vllm_cpu_kv_cache_mb == 256


def test_verify_every_is_checked_and_resolves_by_device():
    from megatron_maspo.parallel.device import on_cuda

    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="rollout.verify_every"):
            RolloutConfig(verify_every=bad)
    assert RolloutConfig(verify_every=0).verify_every_resolved == 0
    assert RolloutConfig(verify_every=8).verify_every_resolved == 8
    assert RolloutConfig().verify_every_resolved == (64 if on_cuda() else 1)


def test_fp8_rollout_is_a_vllm_setting_without_held_weight_verification():
    from megatron_maspo.rollout.vllm_engine import quantization_kwargs

    fp8 = RolloutConfig(engine="vllm", vllm_quantization="fp8")
    assert fp8.verify_every_resolved == 0  # the engine holds FP8 bytes, not the export
    assert quantization_kwargs(fp8) == {"quantization": "fp8"}
    assert quantization_kwargs(RolloutConfig(engine="vllm")) == {}
    with pytest.raises(ValueError, match="needs rollout.engine in \\[.vllm.\\]"):
        RolloutConfig(vllm_quantization="fp8")
    with pytest.raises(ValueError, match="accepted: \\[None, 'fp8'\\]"):
        RolloutConfig(engine="vllm", vllm_quantization="int4")
    with pytest.raises(ValueError, match="set verify_every=0"):
        RolloutConfig(engine="vllm", vllm_quantization="fp8", verify_every=1)


def test_fp8_rollout_needs_a_rollout_correction():
    from megatron_maspo.recipes.registry import resolve_config

    sets = ["rollout.engine=vllm", "rollout.vllm_quantization=fp8"]
    with pytest.raises(ValueError, match="quantised policy, not the trained one: it needs loss.tis_cap"):
        resolve_config("tiny", None, sets)
    assert resolve_config("tiny", None, [*sets, "loss.tis_cap=2.0"]).rollout.vllm_quantization == "fp8"

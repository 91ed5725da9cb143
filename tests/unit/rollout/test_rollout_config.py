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

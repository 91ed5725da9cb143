"""Qwen3-235B-A22B (235 B total, 22 B active) MASPO layout: 32 nodes x 8 H100 (80 GB), TP 4 x PP 2 x EP 32.

    maspo plan qwen3_235b_a22b_maspo --nodes 32 --splits
    maspo check qwen3_235b_a22b_maspo
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.overrides import set_path
from megatron_maspo.recipes.base import paper_config

NAME = "qwen3-235b-a22b-maspo"


def config() -> MaspoConfig:
    cfg = paper_config(name=NAME, source="/models/Qwen3-235B-A22B", arch="qwen3-235b-a22b", alpha=0.3,
                       nodes=32, tp=4, pp=2, ep=32, recompute="full", vllm_tp=8,
                       vllm_gpu_memory_utilization=0.6)
    for key, value in (("rollout.vllm_quantization", "fp8"), ("loss.tis_cap", 2.0),
                       ("train.offload_params", True), ("train.offload_grads", True),
                       ("train.offload_optimizer", True)):
        cfg = set_path(cfg, key, value)
    return cfg

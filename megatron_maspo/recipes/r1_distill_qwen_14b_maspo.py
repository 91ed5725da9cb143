"""MASPO paper setting on DeepSeek-R1-Distill-Qwen-14B (alpha 0.5, §5.4), 4 nodes x 8 GPUs, TP 4.

    maspo plan r1_distill_qwen_14b_maspo --nodes 4 --gpus-per-node 8
    maspo launch r1_distill_qwen_14b_maspo --executor slurm --nodes 4 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import paper_config

NAME = "r1-distill-qwen-14b-maspo"


def config() -> MaspoConfig:
    cfg = paper_config(name=NAME, source="/models/DeepSeek-R1-Distill-Qwen-14B",
                       arch="r1-distill-qwen-14b", alpha=0.5, nodes=4, tp=4, vllm_tp=2)
    return cfg

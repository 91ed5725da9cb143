"""MASPO paper setting on DeepSeek-R1-Distill-Qwen-1.5B, one node of 8 GPUs.

alpha = 0.3 as for 7B (the paper does not state the 1.5B value; its README suggests 0.5 for small
models: --set loss.alpha=0.5).

    maspo plan r1_distill_qwen_1p5b_maspo --nodes 1 --gpus-per-node 8
    maspo launch r1_distill_qwen_1p5b_maspo --executor slurm --nodes 1 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import paper_config

NAME = "r1-distill-qwen-1.5b-maspo"


def config() -> MaspoConfig:
    cfg = paper_config(name=NAME, source="/models/DeepSeek-R1-Distill-Qwen-1.5B",
                       arch="r1-distill-qwen-1.5b", alpha=0.3, nodes=1)
    return cfg

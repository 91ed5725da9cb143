"""GRPO baseline (clip 1 +- 0.2) of ``r1_distill_qwen_7b_maspo``:
same data, batch, optimizer and layout.

    maspo plan r1_distill_qwen_7b_grpo --nodes 4 --gpus-per-node 8
    maspo launch r1_distill_qwen_7b_grpo --executor slurm --nodes 4 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import grpo, paper_config

NAME = "r1-distill-qwen-7b-grpo"


def config() -> MaspoConfig:
    cfg = paper_config(name=NAME, source="/models/DeepSeek-R1-Distill-Qwen-7B",
                       arch="r1-distill-qwen-7b", alpha=0.3, nodes=4, tp=2)
    return grpo(cfg, NAME)

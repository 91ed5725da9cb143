"""GRPO baseline (clip 1 +- 0.2) of ``r1_distill_qwen_1p5b_maspo``:
same data, batch, optimizer and layout.

    maspo plan r1_distill_qwen_1p5b_grpo --nodes 1 --gpus-per-node 8
    maspo launch r1_distill_qwen_1p5b_grpo --executor slurm --nodes 1 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import grpo, paper_config

NAME = "r1-distill-qwen-1.5b-grpo"


def config() -> MaspoConfig:
    cfg = paper_config(name=NAME, source="/models/DeepSeek-R1-Distill-Qwen-1.5B",
                       arch="r1-distill-qwen-1.5b", alpha=0.3, nodes=1)
    return grpo(cfg, NAME)

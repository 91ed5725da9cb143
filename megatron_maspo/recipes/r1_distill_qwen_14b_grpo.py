"""GRPO baseline (clip 1 +- 0.2) of ``r1_distill_qwen_14b_maspo``:
same data, batch, optimizer and layout.

    maspo plan r1_distill_qwen_14b_grpo --nodes 4 --gpus-per-node 8
    maspo launch r1_distill_qwen_14b_grpo --executor slurm --nodes 4 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import grpo, paper_config

NAME = "r1-distill-qwen-14b-grpo"


def config() -> MaspoConfig:
    cfg = paper_config(name=NAME, source="/models/DeepSeek-R1-Distill-Qwen-14B",
                       arch="r1-distill-qwen-14b", alpha=0.5, nodes=4, tp=4, vllm_tp=2)
    return grpo(cfg, NAME)

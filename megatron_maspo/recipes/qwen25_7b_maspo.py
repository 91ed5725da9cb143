"""MASPO with the paper's hyper-parameters on the Qwen2.5-7B base model, 4 nodes x 8 GPUs, TP 2.

    maspo plan qwen25_7b_maspo --nodes 4 --gpus-per-node 8
    maspo launch qwen25_7b_maspo --executor slurm --nodes 4 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import paper_config

NAME = "qwen2.5-7b-maspo"


def config() -> MaspoConfig:
    cfg = paper_config(name=NAME, source="/models/Qwen2.5-7B",
                       arch="qwen2.5-7b", alpha=0.3, nodes=4, tp=2)
    return cfg

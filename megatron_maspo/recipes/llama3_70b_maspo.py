"""Llama-3-70B layout: MASPO paper hyper-parameters, 8 nodes x 8 GPUs, TP 8 x PP 4 (DP 2), vLLM TP 8.

Llama-3 has an 8k context, so responses are capped at 8192 - 1024 prompt tokens. Full recompute and the
distributed optimizer keep the trainer under ~30 GiB per GPU, leaving half of each GPU to the engine.

    maspo plan llama3_70b_maspo --nodes 8 --gpus-per-node 8
    maspo launch llama3_70b_maspo --executor slurm --nodes 8 --dry-run
"""

from __future__ import annotations

import dataclasses

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import MAX_PROMPT_TOKENS, paper_config

NAME = "llama3-70b-maspo"


def config() -> MaspoConfig:
    cfg = paper_config(name=NAME, source="/models/Meta-Llama-3-70B", arch="llama3-70b", alpha=0.3,
                       nodes=8, tp=8, pp=4, recompute="full", vllm_tp=8)
    rollout = dataclasses.replace(cfg.rollout, max_new_tokens=8192 - MAX_PROMPT_TOKENS)
    return dataclasses.replace(cfg, rollout=rollout)

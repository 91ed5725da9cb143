"""Llama-3.3-70B at 16k tokens per sequence with context parallelism: 16 nodes x 8 GPUs, TP 4 x PP 4 x
CP 4 (DP 2), vLLM TP 8 (the layout of NeMo-RL's published Llama-3.3-70B 16k run).

Each packed row holds up to 16,384 tokens (one whole 16k sequence); CP 4 splits it into 8 chunks, two
per CP rank, so ``train.max_tokens_per_micro_batch`` (which counts tokens per CP rank) is 4,096.
Transformer Engine's ring attention (``parallel.cp_comm_type='p2p'``) exchanges K/V between them.

    maspo plan llama33_70b_16k_cp --nodes 16 --gpus-per-node 8
    maspo launch llama33_70b_16k_cp --executor slurm --nodes 16 --dry-run
"""

from __future__ import annotations

import dataclasses

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import MAX_PROMPT_TOKENS, paper_config

NAME = "llama33-70b-16k-cp"
SEQ = 16384
CP = 4


def config() -> MaspoConfig:
    cfg = paper_config(name=NAME, source="/models/Llama-3.3-70B-Instruct", arch="llama3.3-70b",
                       alpha=0.3, nodes=16, tp=4, pp=4, recompute="full", vllm_tp=8)
    parallel = dataclasses.replace(cfg.parallel, cp=CP, cp_comm_type="p2p")
    model = dataclasses.replace(cfg.model, attention_backend="te")
    rollout = dataclasses.replace(cfg.rollout, max_new_tokens=SEQ - MAX_PROMPT_TOKENS)
    train = dataclasses.replace(cfg.train, max_tokens_per_micro_batch=SEQ // CP)
    return dataclasses.replace(cfg, parallel=parallel, model=model, rollout=rollout, train=train)

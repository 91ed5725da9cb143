"""GLM-4.5-Air (106 B total, 12 B active) MoE layout: MASPO paper hyper-parameters, 16 nodes x 8 GPUs,
TP 2 x EP 32 x PP 2 (DP 32; 46 layers split 23 + 23; experts 4 per GPU, expert DP 2), vLLM at 0.45 of a
GPU (at 0.5 the colocated rollout peak is 80.2 GiB, over the 80 GiB card: ``maspo plan``).

Tensor parallelism with expert parallelism needs Megatron sequence parallelism, which
``parallel.sequence_parallel`` turns on by default for MoE at TP > 1 (the TE spec on GPU; the local spec
runs it too, ``model/sp_norm.py``). The router's fp32 correction bias stays frozen during RL
(``model.moe_expert_bias=false``, as NeMo-RL's and verl's Megatron recipes do). The model's one MTP layer
is passed through conversion, not trained. vLLM runs the model at TP 8 (one node).

    maspo plan glm45_air_maspo --nodes 16 --gpus-per-node 8
    maspo check glm45_air_maspo
    maspo launch glm45_air_maspo --executor slurm --nodes 16 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import paper_config

NAME = "glm45-air-maspo"


def config() -> MaspoConfig:
    return paper_config(name=NAME, source="/models/GLM-4.5-Air", arch="glm-4.5-air", alpha=0.3,
                        nodes=16, tp=2, pp=2, ep=32, recompute="full", vllm_tp=8,
                        vllm_gpu_memory_utilization=0.45)

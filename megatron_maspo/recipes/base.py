"""Shared bases for the cluster recipes: the MASPO paper's training setting (loss-formulas.md §13.9).

Paper setting (Fu et al. 2026, §5.1 and App. C): DeepSeek-R1-Distill-Qwen backbones, DAPO-Math-17k,
rollout batch 512 prompts x G = 8 responses, mini-batch 32 prompts => 16 optimizer steps per rollout
step, maximum length 8192, reward +1/-1 from math-verify, AdamW (0.9, 0.95) at a constant lr 1e-6 with no
warm-up and no KL; MASPO sigma_base = 1, beta = 0.03, alpha 0.3 (1.5B/7B) or 0.5 (14B); baselines clip at
0.2; temperature 1.0. What the paper leaves open (weight decay, prompt budget, step count) is set here to
verl's defaults and marked as such.

Recipes call :func:`paper_config` with the model and the layout the planner accepts on ``nodes x 8``
80 GB GPUs (``maspo plan <recipe> --nodes N --gpus-per-node 8``), and :func:`grpo` for the baseline.
"""

from __future__ import annotations

import dataclasses

from megatron_maspo.config import MaspoConfig
from megatron_maspo.data.config import DataConfig
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.model.config import ModelConfig
from megatron_maspo.parallel.config import ParallelConfig
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.train.config import CheckpointConfig, OptimConfig, TrainConfig

GPUS_PER_NODE = 8
DAPO_MATH = "/data/dapo-math-17k/dapo-math-17k.parquet"
"""Conventional location of DAPO-Math-17k on the cluster (mount it there or override data.source)."""
MAX_PROMPT_TOKENS = 1024
"""Prompt budget; the paper states only the 8192 response length (verl max_response_length)."""


def paper_config(*, name: str, source: str, arch: str, alpha: float, nodes: int, tp: int = 1,
                 pp: int = 1, ep: int = 1, recompute: str | None = "full", vllm_tp: int = 1,
                 vllm_gpu_memory_utilization: float = 0.5) -> MaspoConfig:
    """The MASPO paper's setting for one backbone and one layout.

    Args:
        name: run name; the run directory is ``runs/<name>``.
        source: Hugging Face folder of the backbone on the cluster.
        arch: ``megatron_maspo.model.presets`` name describing ``source`` (for planning off-cluster).
        alpha: MASPO mass exponent alpha.
        nodes: intended cluster size in 8-GPU nodes; sets ``parallel.world_size``.
        tp, pp, ep, recompute, vllm_tp, vllm_gpu_memory_utilization: the layout the planner accepts.
    """
    return MaspoConfig(
        model=ModelConfig(source=source, arch=arch, bf16=True, recompute=recompute),
        parallel=ParallelConfig(tp=tp, pp=pp, ep=ep, distributed_optimizer=True,
                                world_size=nodes * GPUS_PER_NODE),
        loss=LossConfig(method="maspo", sigma_base=1.0, alpha=alpha, beta_high=0.03, beta_low=0.03,
                        eps_low=0.2, eps_high=0.2, kl_coef=0.0, entropy_coef=0.0),
        optim=OptimConfig(lr=1e-6, min_lr=1e-6, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.01,
                          clip_grad=1.0, warmup_steps=0, lr_decay_style="constant"),
        rollout=RolloutConfig(engine="vllm", group_size=8, temperature=1.0, top_p=1.0, max_new_tokens=8192,
                              vllm_tp=vllm_tp, vllm_gpu_memory_utilization=vllm_gpu_memory_utilization,
                              sleep_level=2),
        data=DataConfig(source=DAPO_MATH, format="dapo", max_prompt_tokens=MAX_PROMPT_TOKENS),
        train=TrainConfig(steps=300, prompts_per_step=512, mini_batches_per_step=16,
                          max_tokens_per_micro_batch=16384,
                          deterministic=False, seed=1234),
        checkpoint=CheckpointConfig(run_dir=f"runs/{name}", save_every=10, keep_last=2),
    )


def grpo(cfg: MaspoConfig, name: str) -> MaspoConfig:
    """The GRPO baseline of a MASPO recipe: same everything, hard clip at 1 +- 0.2."""
    loss = dataclasses.replace(cfg.loss, method="grpo", eps_low=0.2, eps_high=0.2)
    ckpt = dataclasses.replace(cfg.checkpoint, run_dir=f"runs/{name}")
    return dataclasses.replace(cfg, loss=loss, checkpoint=ckpt)

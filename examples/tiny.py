"""The CPU default: a tiny Qwen2-style model learns single-digit addition with MASPO in minutes.

A short supervised warm start teaches the ``\\boxed{}`` answer format (and some sums); MASPO RL with
the built-in engine and math-verify rewards then raises the reward. ``maspo train`` runs this recipe.
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.data.config import DataConfig
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.model.config import ModelConfig
from megatron_maspo.reward.config import RewardConfig
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.train.config import CheckpointConfig, OptimConfig, TrainConfig


def config() -> MaspoConfig:
    return MaspoConfig(
        model=ModelConfig(source="tiny", tiny_num_layers=2, tiny_hidden_size=64),
        loss=LossConfig(method="maspo"),
        optim=OptimConfig(lr=2e-4, weight_decay=0.0, clip_grad=1.0),
        rollout=RolloutConfig(engine="builtin", group_size=8, temperature=1.0, max_new_tokens=12),
        reward=RewardConfig(num_workers=1),
        data=DataConfig(source="synthetic", num_examples=200, max_operand=9),
        train=TrainConfig(steps=40, prompts_per_step=16, mini_batches_per_step=2, sft_steps=60,
                          sft_lr=3e-3, max_tokens_per_micro_batch=256),
        checkpoint=CheckpointConfig(run_dir="runs/tiny", save_every=10),
    )

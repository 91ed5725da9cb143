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
        model=ModelConfig(source="tiny", tiny_num_layers=2, tiny_hidden_size=128),
        loss=LossConfig(method="maspo"),
        # Tuned on this task: 1e-3 and above make the policy drift (KL 0.1-0.3 per step) and collapse;
        # 1e-4 learns too slowly for 50 steps.
        optim=OptimConfig(lr=3e-4, weight_decay=0.0, clip_grad=1.0),
        rollout=RolloutConfig(engine="builtin", group_size=8, temperature=1.0, max_new_tokens=12),
        reward=RewardConfig(num_workers=1),
        # A bare prompt (no chat template): short rows keep a CPU step around a second.
        data=DataConfig(source="synthetic", num_examples=200, max_operand=9, max_prompt_tokens=128,
                        apply_chat_template=False),
        train=TrainConfig(steps=60, prompts_per_step=32, mini_batches_per_step=4, sft_steps=100,
                          sft_lr=3e-3, max_tokens_per_micro_batch=256),
        checkpoint=CheckpointConfig(run_dir="runs/tiny", save_every=10),
    )

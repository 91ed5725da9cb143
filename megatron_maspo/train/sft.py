"""Supervised warm start: teach the answer format (and some answers) before RL.

The gradient of any ratio-based loss at ``rho = 1`` with advantage 1 is exactly the token-mean NLL
gradient, and one mini-batch per step keeps ``rho = 1`` (the actor recomputes old log-probs with
the same packing). So the warm start reuses the actor's packing, forward and exact token-mean path
unchanged; only the learning rate differs, set directly and restored from the scheduler afterwards.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from megatron_maspo.loss.config import LossConfig
from megatron_maspo.train.actor.samples import Sample
from megatron_maspo.train.config import TrainConfig

logger = logging.getLogger(__name__)


def sft_samples(examples: list, tokenizer: Any, idx: list[int]) -> list[Sample]:
    """(prompt, ``\\boxed{answer}`` + EOS) pairs for the given dataset indices."""
    out = []
    for k, i in enumerate(idx):
        ex = examples[i]
        resp = tokenizer.encode(f"\\boxed{{{ex.answer}}}", add_special_tokens=False)
        out.append(Sample(prompt_ids=ex.prompt_ids, response_ids=resp + [tokenizer.eos_token_id],
                          advantage=1.0, prompt_index=k))
    return out


def sft_warm_start(actor: Any, examples: list, tokenizer: Any, tc: TrainConfig, *, rank: int,
                   progress: Any = None) -> dict[str, float]:
    """``tc.sft_steps`` supervised steps at ``tc.sft_lr``; returns the last step's metrics.

    ``progress``: a :class:`~megatron_maspo.train.observe.progress.Progress` to show the steps on (or None).
    """
    g = torch.Generator().manual_seed(tc.seed + 17)
    batch = tc.prompts_per_step * 2
    it: Any = range(tc.sft_steps)
    if progress is not None and rank == 0:
        it = progress.iterate(it, "SFT warm start", unit="step")
    metrics: dict[str, float] = {}
    # The warm start must not depend on the RL method: PPO-clip at rho = 1 has exactly the NLL gradient,
    # whereas e.g. QUATRO's per-prompt terms do not. Swap the loss for the warm start only.
    rl_loss = actor.loss_cfg
    actor.loss_cfg = LossConfig(method="grpo", aggregation="token-mean")
    try:
        metrics = _sft_steps(actor, examples, tokenizer, tc, it, g, batch)
    finally:
        actor.loss_cfg = rl_loss
    actor.scheduler.step(increment=0)  # back to the RL learning rate (see below on Adam's moments)
    logger.info("sft warm start: %d steps done", tc.sft_steps)
    return metrics


def _sft_steps(actor: Any, examples: list, tokenizer: Any, tc: TrainConfig, it: Any, g: torch.Generator,
               batch: int) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for _ in it:
        idx = torch.randint(len(examples), (batch,), generator=g).tolist()
        samples = sft_samples(examples, tokenizer, idx)
        # One mini-batch holding every sample (the RL plan would split it into several).
        plan = actor.plan_one(samples)  # the actor's packing rules (CP padding, per-rank budget)
        actor.old_logprobs.fill(samples, [plan])
        ctx = actor.forward_backward(samples, plan)
        for group in actor.optimizer.param_groups:
            group["lr"] = tc.sft_lr
        actor.optimizer.step()
        metrics = {k: float(v) for k, v in ctx.metrics.items()} if ctx.metrics else {}
    # Adam's moments are kept for RL: reset moments make the first RL updates ~lr per parameter
    # whatever the gradient (sign-like), which wrecked the warm-started policy.
    return metrics

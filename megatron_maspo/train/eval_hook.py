"""Evaluation during training: Avg@k / Pass@k on held-out prompts every ``eval.every`` rollout steps.

Runs on the first engine of the rollout fleet (global rank 0; the other engines wait), between two
steps, right after the weight sync, so it evaluates exactly the policy that generates the next rollout. Metric keys (one row of metrics.jsonl):
``eval/<benchmark>/avg@k``, ``eval/<benchmark>/pass@j`` for j in powers of two up to k (the JSON
report of ``maspo eval`` has every j), ``eval/<benchmark>/dropped`` and ``eval/average/*``.
Other ranks return ``{}`` (they only log on rank 0) and wait at the next step's gather; keep the
held-out set small enough that one evaluation fits the collective timeout.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_maspo.data.config import DataConfig
from megatron_maspo.eval.config import EvalConfig
from megatron_maspo.eval.datasets import eval_datasets
from megatron_maspo.eval.metrics import table_ks
from megatron_maspo.eval.runner import evaluate
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.rollout.types import SamplingParams

logger = logging.getLogger(__name__)


class TrainingEval:
    """Builds the held-out sets once (on the engine's rank) and evaluates on schedule."""

    def __init__(self, ec: EvalConfig, data: DataConfig, rollout: RolloutConfig, *, seed: int,
                 tokenizer: Any, is_engine_rank: bool, reward: Any = None) -> None:
        self.ec, self.rollout, self.seed, self.tokenizer = ec, rollout, seed, tokenizer
        self.reward = reward
        """``RewardConfig`` for an evaluation grader of its own (``eval.grader`` 'prime_math')."""
        self._own_grader: Any = None
        self.datasets: dict = {}
        self.dropped: dict[str, int] = {}
        if self.ec.every and is_engine_rank:
            self.datasets, self.dropped = eval_datasets(
                data, tokenizer, files=self.ec.data, benchmarks=self.ec.benchmarks,
                num_problems=self.ec.num_problems)

    def due(self, step: int, *, final: bool = False) -> bool:
        """Evaluate before rollout step ``step`` (every N steps from 0), or after the last one."""
        return bool(self.ec.every) and (final or step % self.ec.every == 0)

    def __call__(self, engine: Any, grader: Any) -> dict[str, float]:
        """``eval/*`` metrics of the engine's current weights; ``{}`` off the engine's rank.

        ``grader`` is the training reward; with ``eval.grader='prime_math'`` the paper's evaluation rules
        grade instead, on a pool of their own started at the first evaluation.
        """
        if engine is None or not self.datasets:
            return {}
        if self.ec.grader == "prime_math":
            if self._own_grader is None:
                from megatron_maspo.reward.config import RewardConfig
                from megatron_maspo.reward.prime_grader import prime_math_reward

                self._own_grader = prime_math_reward(self.reward or RewardConfig())
            grader = self._own_grader
        rc, ec = self.rollout, self.ec
        params = SamplingParams(n=ec.k, temperature=rc.temperature if ec.temperature is None else ec.temperature,
                                top_p=rc.top_p, max_tokens=ec.max_new_tokens or rc.max_new_tokens,
                                stop_token_ids=[self.tokenizer.eos_token_id], seed=self.seed + 17)
        report = evaluate(engine, self.datasets, k=ec.k, sampling=params, grader=grader,
                          tokenizer=self.tokenizer, pass_ks=table_ks(ec.k), dropped=self.dropped,
                          dropped_as_wrong=ec.dropped_as_wrong)
        out: dict[str, float] = {"eval/seconds": report.seconds}
        for bench, row in report.summary.items():
            for key, v in row.items():
                if key == "num_problems":
                    continue
                out[f"eval/{bench}/{'dropped' if key == 'num_dropped' else key}"] = float(v)
        logger.info("eval: %s", {k: round(v, 4) for k, v in out.items() if "/average/" in k})
        return out

    def close(self) -> None:
        """Stop the evaluation grader's workers, if one was started."""
        if self._own_grader is not None:
            self._own_grader.close()
            self._own_grader = None


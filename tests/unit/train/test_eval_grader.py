"""``eval.grader``: the paper recipes evaluate with prime_math (MASPO §5.1), in ``maspo eval`` and in the
in-training evaluation, which then grades on a pool of its own (real grader pools; a constant engine,
which is not under test)."""

from __future__ import annotations

import pytest

from megatron_maspo.data.config import DataConfig
from megatron_maspo.data.tokenizer import build_byte_tokenizer
from megatron_maspo.eval.config import EvalConfig
from megatron_maspo.recipes.registry import load_recipe
from megatron_maspo.reward.config import RewardConfig
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.rollout.types import Completion, SamplingParams
from megatron_maspo.train.eval_hook import TrainingEval


class _Constant:
    """Answers ``\\boxed{0}`` to every prompt."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        ids = self.tok.encode(r"\boxed{0}", add_special_tokens=False) + [self.tok.eos_token_id]
        return [[Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")] * params.n
                for _ in prompts]


def test_paper_recipes_evaluate_with_prime_math_and_bad_values_are_refused():
    assert load_recipe("r1_distill_qwen_7b_maspo").eval.grader == "prime_math"
    assert load_recipe("tiny").eval.grader == "math_verify"
    with pytest.raises(ValueError, match="eval.grader='exact'; accepted"):
        EvalConfig(grader="exact")


def test_in_training_evaluation_grades_on_its_own_prime_math_pool():
    tok = build_byte_tokenizer()
    ev = TrainingEval(EvalConfig(every=1, k=2, num_problems=3, grader="prime_math"), DataConfig(),
                      RolloutConfig(max_new_tokens=8), seed=0, tokenizer=tok, is_engine_rank=True,
                      reward=RewardConfig(num_workers=1))
    try:
        out = ev(_Constant(tok), grader=None)  # the training reward is not used: None would fail
    finally:
        ev.close()
    assert "eval/average/avg@2" in out and 0.0 <= out["eval/average/avg@2"] <= 1.0
    with pytest.raises(TypeError):  # math_verify grades with the training reward it is given
        TrainingEval(EvalConfig(every=1, k=2, num_problems=3), DataConfig(), RolloutConfig(max_new_tokens=8),
                     seed=0, tokenizer=tok, is_engine_rank=True)(_Constant(tok), grader=None)

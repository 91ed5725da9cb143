"""The evaluation runner: a scripted engine (test double for the engine), the real grader and tokenizer."""

from __future__ import annotations

import json

import pytest

from megatron_maspo.data import DataConfig, Example, tokenize_examples
from megatron_maspo.data.tokenizer import build_byte_tokenizer
from megatron_maspo.eval import evaluate
from megatron_maspo.reward import RewardConfig
from megatron_maspo.reward.math_reward import MathReward
from megatron_maspo.rollout.types import Completion, SamplingParams


class ScriptedEngine:
    """Returns given response texts per prompt text, in order (the engine is not under test)."""

    def __init__(self, tokenizer, script: dict[str, list[str]]) -> None:
        self.tok, self.script, self.calls = tokenizer, script, []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self.calls.append((len(prompts), params.n))
        out = []
        for ids in prompts:
            question = self.tok.decode(ids).split("user\n", 1)[1].split("<|im_end|>")[0]
            texts = self.script[question][: params.n]
            out.append(
                [
                    Completion(
                        token_ids=self.tok.encode(t, add_special_tokens=False)
                        + [self.tok.eos_token_id],
                        logprobs=[0.0] * (len(t) + 1),
                        finish_reason="stop" if t else "length",
                    )
                    for t in texts
                ]
            )
        return out


def test_evaluate_aggregates_per_benchmark() -> None:
    tok = build_byte_tokenizer()
    script = {
        "1+1?": [r"\boxed{2}", r"\boxed{3}", "Answer: 2", ""],  # 2 of 4 correct
        "half?": [r"\boxed{0.5}"] * 4,  # 4 of 4 (gold 1/2)
        "pi?": [r"\boxed{3.14}"] * 4,  # 0 of 4
    }
    cfg = DataConfig(source="unused.jsonl")
    bench = {
        "toy_a": tokenize_examples(
            [Example(prompt="1+1?", answer="2"), Example(prompt="half?", answer=r"\frac12")],
            tok,
            cfg,
        ),
        "toy_b": tokenize_examples([Example(prompt="pi?", answer=r"\pi")], tok, cfg),
        "empty": [],
    }
    engine = ScriptedEngine(tok, script)
    with MathReward(RewardConfig(num_workers=1)) as grader:
        report = evaluate(
            engine,
            bench,
            k=4,
            sampling=SamplingParams(n=1, temperature=0.6),
            grader=grader,
            tokenizer=tok,
        )
        assert engine.calls == [(2, 4), (1, 4)]
        assert report.num_correct == {"toy_a": [2, 4], "toy_b": [0]}
        a, b, avg = report.summary["toy_a"], report.summary["toy_b"], report.summary["average"]
        assert a["avg@4"] == pytest.approx(0.75) and a["pass@4"] == 1.0
        assert a["pass@1"] == pytest.approx(0.75) and a["pass@2"] == pytest.approx(
            (1 - 1 / 6 + 1) / 2
        )
        assert b["pass@4"] == 0.0 and avg["avg@4"] == pytest.approx(0.375)
        assert report.status_counts["correct"] == 6 and report.finish_reasons == {
            "stop": 11,
            "length": 1,
        }
        assert json.loads(report.to_json())["summary"]["toy_a"]["pass@4"] == 1.0
        assert "| toy_a |" in report.table()
        with pytest.raises(ValueError, match="prompt_ids"):
            evaluate(
                engine,
                {"x": [Example(prompt="1+1?", answer="2")]},
                k=4,
                sampling=SamplingParams(),
                grader=grader,
                tokenizer=tok,
            )
        with pytest.raises(ValueError, match="expected 8 each"):
            evaluate(
                engine,
                {"toy_a": bench["toy_a"]},
                k=8,
                sampling=SamplingParams(),
                grader=grader,
                tokenizer=tok,
            )

"""The paper's evaluation protocol pieces: benchmark discovery, training prompt template, dropped
prompts counted (not silently removed), Pass@1..k by default."""

from __future__ import annotations

import json

import pytest

from megatron_maspo.data import DataConfig
from megatron_maspo.data.tokenizer import build_byte_tokenizer
from megatron_maspo.eval import evaluate
from megatron_maspo.eval.benchmarks import find_benchmarks
from megatron_maspo.eval.datasets import eval_datasets
from megatron_maspo.reward import RewardConfig
from megatron_maspo.reward.math_reward import MathReward
from megatron_maspo.rollout.types import SamplingParams
from tests.unit.eval.test_runner import ScriptedEngine


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_find_benchmarks_by_common_names(tmp_path):
    _write(tmp_path / "aime24.jsonl", [{"problem": "p", "answer": "1"}])
    _write(tmp_path / "AIME_2025" / "test.jsonl", [{"problem": "p", "answer": "1"}])
    _write(tmp_path / "amc23.jsonl", [{"question": "p", "answer": 1}])
    _write(tmp_path / "math-500" / "test.jsonl", [{"problem": "p", "solution": "\\boxed{1}"}])
    _write(tmp_path / "minerva_math.jsonl", [{"problem": "p", "solution": "\\boxed{1}"}])
    _write(tmp_path / "OlympiadBench" / "OE_TO_maths_en_COMP.json", [{"question": "p", "final_answer": ["1"]}])
    (tmp_path / "notes.txt").write_text("ignored")
    found = find_benchmarks(tmp_path)
    assert sorted(found) == ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]
    assert found["aime25"].name == "test.jsonl" and found["math500"].parent.name == "math-500"
    _write(tmp_path / "aime24_v2.jsonl", [{"problem": "p", "answer": "1"}])
    with pytest.raises(ValueError, match="aime24"):
        find_benchmarks(tmp_path)
    with pytest.raises(FileNotFoundError):
        find_benchmarks(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no benchmark"):
        find_benchmarks(tmp_path / "empty")


def test_eval_prompts_use_the_training_template_and_count_dropped(tmp_path):
    tok = build_byte_tokenizer()
    f = tmp_path / "aime24.jsonl"
    _write(f, [{"problem": "1+1?", "answer": "2"}, {"problem": "x" * 400, "answer": "3"}])
    data = DataConfig(prompt_template="Q: {question} Answer:", max_prompt_tokens=200)
    sets, dropped = eval_datasets(data, tok, files=[str(f)])
    assert dropped == {"aime24": 1} and len(sets["aime24"]) == 1
    assert "Q: 1+1? Answer:" in tok.decode(sets["aime24"][0].prompt_ids)


def test_dropped_prompts_scored_wrong_or_excluded_and_all_pass_ks(tmp_path):
    tok = build_byte_tokenizer()
    f = tmp_path / "b.jsonl"
    _write(f, [{"problem": "1+1?", "answer": "2"}])
    sets, _ = eval_datasets(DataConfig(), tok, files=[str(f)])
    engine = ScriptedEngine(tok, {"1+1?": [r"\boxed{2}"] * 4})
    with MathReward(RewardConfig(num_workers=1)) as grader:
        kw = dict(k=4, sampling=SamplingParams(), grader=grader, tokenizer=tok, dropped={"b": 3})
        wrong = evaluate(engine, sets, **kw)
        excl = evaluate(engine, sets, dropped_as_wrong=False, **kw)
    assert wrong.num_correct["b"] == [4, 0, 0, 0] and wrong.summary["b"]["avg@4"] == 0.25
    assert excl.num_correct["b"] == [4] and excl.summary["b"]["avg@4"] == 1.0
    for rep in (wrong, excl):
        assert rep.dropped == {"b": 3} and rep.summary["b"]["num_dropped"] == 3
        assert [c for c in rep.summary["b"] if c.startswith("pass@")] == [f"pass@{j}" for j in range(1, 5)]
    assert "num_dropped" in wrong.table()

"""``module:function`` hooks: the form is checked, and every failure names the config field."""

from __future__ import annotations

import pytest

from megatron_maspo.data.config import DataConfig
from megatron_maspo.data.dataset import load_examples
from megatron_maspo.plugins import is_target, resolve
from megatron_maspo.reward.config import RewardConfig


def test_target_form():
    assert is_target("pkg.mod:fn") and is_target("m:_f")
    for text in ("data.jsonl", "pkg.mod", "a:b:c", ":fn", "mod:", "runs/x:y", "C:\\data.jsonl"):
        assert not is_target(text), text


@pytest.mark.parametrize("target, fragment", [
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("json:no_such_fn", "has no callable 'no_such_fn'"),
    ("json:__doc__", "has no callable '__doc__'"),
    ("not a target", "expected 'module:function'"),
])
def test_resolve_errors_name_the_field(target, fragment):
    with pytest.raises(ValueError, match="reward.grader") as e:
        resolve(target, "reward.grader")
    assert fragment in str(e.value)


def test_reward_config_checks_the_form():
    with pytest.raises(ValueError, match="reward.grader"):
        RewardConfig(grader="just_a_name")


def _rows(cfg):
    return [{"question": "1+1=", "answer": "2"}, {"question": "no answer"}, "not a dict",
            {"problem": "2+2=", "final_answer": 4}]


def test_dataset_function_rows_are_validated_like_a_file():
    examples = load_examples(DataConfig(source=f"{__name__}:_rows"))
    assert [(e.prompt, e.answer) for e in examples] == [("1+1=", "2"), ("2+2=", "4")]

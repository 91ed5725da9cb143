"""A user grader's contract: only a bool scores; broken or slow graders stop the run in one line.

Real pools, real worker processes; the graders are in ``_hooks`` (workers import them by name).
"""

from __future__ import annotations

import logging
import time

import pytest

from megatron_maspo.errors import GraderError
from megatron_maspo.reward import GradeStatus, RewardConfig
from megatron_maspo.reward.math_reward import MathReward, UserGrade
from megatron_maspo.reward.pool import GraderPool

_HOOKS = "tests.unit.reward._hooks"


def test_only_a_bool_scores_nan_strings_none_and_ints_are_invalid(caplog) -> None:
    cfg = RewardConfig(num_workers=2, grader=f"{_HOOKS}:returns_what_it_is_told", max_bad_fraction=1.0)
    responses = ["nan", "no", "none", "one", "true", "false", "npbool"]
    with MathReward(cfg) as reward, caplog.at_level(logging.WARNING):
        out = reward(responses, ["x"] * len(responses))
    S = GradeStatus
    assert out.statuses == [S.INVALID] * 4 + [S.CORRECT, S.WRONG, S.CORRECT]
    assert out.rewards == [-1.0] * 4 + [1.0, -1.0, 1.0]
    assert out.metrics["reward/invalid_count"] == 4
    assert reward.totals["invalid"] == 4  # what the loop reports as reward/invalid_total
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1, lines  # one line per batch, not one per item
    for fragment in (f"{_HOOKS}:returns_what_it_is_told", "4/7", "returned float", "returned str",
                     "returned NoneType", "returned int"):
        assert fragment in lines[0], lines[0]


def test_a_batch_over_the_bad_fraction_stops_with_one_line_naming_the_grader() -> None:
    cfg = RewardConfig(num_workers=1, grader=f"{_HOOKS}:returns_what_it_is_told")  # max_bad_fraction 0.5
    with MathReward(cfg) as reward:
        assert reward(["no", "true", "true"], ["x"] * 3).statuses[0] is GradeStatus.INVALID  # 1/3 passes
        with pytest.raises(GraderError) as e:
            reward(["no", "none", "true"], ["x"] * 3)
    msg = str(e.value)
    assert "\n" not in msg and f"{_HOOKS}:returns_what_it_is_told" in msg and "2/3" in msg, msg
    assert "reward.max_bad_fraction=0.5" in msg, msg
    # a float or None is not helped by a longer timeout: the remedy says what the grader must return
    assert msg.endswith("stopping (return a bool from the grader (True when the answer is correct))"), msg
    assert "timeout_s" not in msg, msg


def test_a_sleeping_grader_stops_within_the_batch_deadline() -> None:
    # 16 items, 2 workers, 2 s per item: item by item this was 16 s per batch; the batch budget is
    # 2 + 0.25 * ceil(16 / 2) = 4 s from the first dispatch.
    cfg = RewardConfig(num_workers=2, timeout_s=2.0, grader=f"{_HOOKS}:sleeps")
    with MathReward(cfg) as reward:
        assert reward.deadline_s(16) == 4.0
        t0 = time.perf_counter()
        with pytest.raises(GraderError) as e:
            reward(["a"] * 16, ["x"] * 16)
        elapsed = time.perf_counter() - t0
    assert "16/16" in str(e.value) and f"{_HOOKS}:sleeps" in str(e.value) and "deadline" in str(e.value)
    assert "raise reward.timeout_s / reward.grading_budget_s" in str(e.value)
    # The budget plus worker start-up (not counted in the budget) and the kills.
    assert elapsed < 4.0 + 8.0, elapsed


def test_a_grader_dying_in_warm_up_is_named() -> None:
    with (MathReward(RewardConfig(num_workers=1, grader=f"{_HOOKS}:dies_in_warmup")) as reward,
          pytest.raises(GraderError, match=f"grader {_HOOKS}:dies_in_warmup: workers died 3 times")):
        reward(["a"], ["x"])


def test_a_grader_hanging_in_warm_up_is_named() -> None:
    grade = UserGrade(f"{_HOOKS}:hangs_in_warmup")
    with (GraderPool(grade, num_workers=1, timeout_s=1.0, name=grade.target, startup_timeout_s=3.0,
                     warmup=("r", "0.5", "boxed", 64, 1.0)) as pool,
          pytest.raises(GraderError, match=f"grader {_HOOKS}:hangs_in_warmup: worker .* not ready")):
        pool.map([("r", "1", "boxed", 64, 1.0)])


@pytest.mark.parametrize("field, value", [("grading_budget_s", 0.0), ("max_bad_fraction", 1.5)])
def test_settings_are_checked(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        RewardConfig(**{field: value})

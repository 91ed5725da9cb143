"""MathReward: a graded answer table, pathological inputs, crashes and hangs (real math-verify)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_maspo.reward import GradeStatus, RewardConfig
from megatron_maspo.reward.math_reward import MathReward
from tests.unit.reward._hooks import crash_or_grade

# (response, ground truth, correct?)
TABLE = [
    # fractions
    (r"The answer is $\boxed{\frac{1}{2}}$.", "1/2", True),
    (r"\boxed{\dfrac12}", r"\frac{1}{2}", True),
    (r"\boxed{0.5}", r"\frac{1}{2}", True),
    (r"\boxed{2/4}", "1/2", True),
    (r"\boxed{\frac{3}{4}}", "0.75", True),
    (r"\boxed{\frac{1}{3}}", "0.5", False),
    (r"\boxed{-\frac{7}{2}}", "-3.5", True),
    # decimals and integers
    (r"\boxed{0.51}", r"\frac{1}{2}", False),
    (r"\boxed{3.0}", "3", True),
    (r"\boxed{1,000}", "1000", True),
    (r"\boxed{42}", "41", False),
    (r"\boxed{-5}", "5", False),
    (r"\boxed{3.14159}", r"\pi", False),
    # radicals, expressions, pi
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", True),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", True),
    (r"\boxed{x^2+2x}", "x^2+2x+1", False),
    (r"\boxed{\pi}", r"\pi", True),
    (r"\boxed{2\pi}", r"\pi", False),
    (r"\boxed{\sqrt{3}/3}", r"\frac{1}{\sqrt{3}}", True),
    (r"\boxed{\binom{5}{2}}", "10", True),
    # intervals
    (r"\boxed{[0, 1)}", "[0,1)", True),
    (r"\boxed{(0,1]}", "[0,1)", False),
    (r"\boxed{(-\infty, 2)}", r"(-\infty,2)", True),
    (r"\boxed{[2,\infty)}", r"(2,\infty)", False),
    # sets and tuples
    (r"\boxed{\{3,2,1\}}", r"\{1,2,3\}", True),
    (r"\boxed{\{1,2\}}", r"\{1,2,3\}", False),
    (r"\boxed{(1, 2)}", "(1,2)", True),
    (r"\boxed{(2, 1)}", "(1,2)", False),
    # percentages and units
    (r"\boxed{50\%}", "0.5", True),
    (r"\boxed{10\text{ cm}}", "10", True),
    (r"\boxed{30^\circ}", "30", True),
    (r"\boxed{12 \text{ meters}}", "13", False),
    # LaTeX variants
    (r"\boxed{\tfrac{1}{2}}", "1/2", True),
    (r"\boxed{\left(\frac{1}{2}\right)}", "1/2", True),
    (r"\fbox{7}", "7", True),
    (r"First \boxed{3}, corrected: \boxed{4}", "4", True),
    (r"First \boxed{4}, corrected: \boxed{3}", "4", False),
    (r"\boxed{x = 5}", "5", True),
    # DAPO "Answer:" line fallback
    ("Work...\nAnswer: 17", "17", True),
    ("Answer: $\\frac{2}{3}$", "2/3", True),
    ("Answer: 16", "17", False),
    # missing / unparseable answers
    ("I don't know.", "3", False),
    (r"\boxed{}", "3", False),
    (r"\boxed{\frac{1}{", "1/2", False),
]


@pytest.fixture(scope="module")
def reward() -> MathReward:
    # Generous deadline: the CI box may be oversubscribed; pathological items are bounded either way.
    with MathReward(RewardConfig(num_workers=2, timeout_s=10.0)) as r:
        yield r


def test_answer_table(reward: MathReward) -> None:
    assert len(TABLE) >= 40
    responses, golds, expected = zip(*TABLE)
    out = reward(list(responses), list(golds))
    wrong = [
        (r, g, e, s)
        for r, g, e, s in zip(responses, golds, expected, out.statuses)
        if (s is GradeStatus.CORRECT) != e
    ]
    assert not wrong, wrong
    assert out.rewards == [1.0 if e else -1.0 for e in expected]
    assert out.metrics["reward/correct_count"] == sum(expected)
    assert out.metrics["reward/mean"] == pytest.approx(sum(out.rewards) / len(TABLE))


def test_progress_hook_counts_each_graded_response_once(reward: MathReward) -> None:
    responses, golds, _ = zip(*TABLE)
    calls: list[int] = []
    out = reward(list(responses), list(golds), progress=calls.append)
    assert sum(calls) == len(TABLE) and all(c > 0 for c in calls)
    assert out.rewards == reward(list(responses), list(golds)).rewards


def test_pathological_batch_within_time_limit(reward: MathReward) -> None:
    bad = [
        r"\boxed{" + "{" * 20_000 + "1" + "}" * 20_000 + "}",  # deep nesting
        "The answer is 7. " * 6000 + r"\boxed{8}",  # ~100k characters, real answer at the end
        "x" * 100_000,  # 100k characters of nothing
        r"\boxed{9^{9^{9^{9}}}}",  # huge exponent
        r"\boxed{10^{10^{10^{10}}}!}",
        r"\boxed{\frac{\sqrt{}}{}\left(\right]}",  # invalid LaTeX
        r"\boxed{\begin{matrix}}",
        "\\boxed{" + "+".join(["x"] * 3000) + "}",  # long expression (over max_chars)
        "\udcff\x00\\boxed{1}",  # lone surrogate and NUL
    ]
    good = [(r"\boxed{\frac{1}{2}}", "0.5"), ("Answer: 12", "12")]
    responses = [bad[0], good[0][0], *bad[1:], good[1][0]]
    golds = ["1", good[0][1], "8", "3", "1", "2", "1", "1", "1", "2", good[1][1]]
    t0 = time.perf_counter()
    out = reward(responses, golds)
    elapsed = time.perf_counter() - t0
    # Every item is bounded by the deadline (plus a worker respawn): 11 items on 2 workers need at
    # most ceil(11 / 2) = 6 sequential slots.
    assert elapsed < 6 * (reward.config.timeout_s + 2.0), elapsed
    assert out.statuses[1] is GradeStatus.CORRECT and out.statuses[-1] is GradeStatus.CORRECT
    assert out.statuses[2] is GradeStatus.CORRECT  # the 100k-character response with a final box
    assert all(
        s is not GradeStatus.CORRECT for i, s in enumerate(out.statuses) if i not in (1, 2, 10)
    )


def test_crash_hang_raise_and_memory_bomb_are_survived_and_counted() -> None:
    # 6 of 8 items fail on purpose: no batch deadline or bad-fraction stop here (test_grader_contract.py).
    cfg = RewardConfig(num_workers=2, timeout_s=3.0, grading_budget_s=30.0, max_bad_fraction=1.0)
    with MathReward(cfg, grade_fn=crash_or_grade) as reward:
        responses = [
            "CRASH",
            r"\boxed{2}",
            "HANG",
            "RAISE",
            r"\boxed{3}",
            "CRASH",
            r"\boxed{5}",
            "ALLOC",
        ]
        golds = ["1", "2", "1", "1", "3", "1", "6", "1"]
        t0 = time.perf_counter()
        out = reward(responses, golds)
        assert time.perf_counter() - t0 < 30
        S = GradeStatus
        assert out.statuses == [
            S.CRASH,
            S.CORRECT,
            S.TIMEOUT,
            S.ERROR,
            S.CORRECT,
            S.CRASH,
            S.WRONG,
            S.ERROR,
        ]
        assert out.rewards == [-1, 1, -1, -1, 1, -1, -1, -1]
        assert out.metrics["reward/crash_count"] == 2 and out.metrics["reward/timeout_count"] == 1
        assert reward.pool_events["crash"] == 2 and reward.pool_events["timeout"] == 1
        assert reward.pool_events["started"] == 2 + 3  # each crash/hang replaced its worker
        # The pool keeps working at full size afterwards.
        assert len(reward.worker_pids()) == 2
        assert reward([r"\boxed{4}"], ["4"]).statuses == [S.CORRECT]


def test_input_validation(reward: MathReward) -> None:
    with pytest.raises(ValueError, match="differ in length"):
        reward(["a"], [])
    with pytest.raises(TypeError, match=r"responses\[0\]"):
        reward([None], ["1"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="fallback"):
        RewardConfig(fallback="last_number")
    with pytest.raises(ValueError, match="correct_reward"):
        RewardConfig(correct_reward=0.0, incorrect_reward=0.0)


def _wait_dead(pid: int, timeout_s: float = 10.0) -> None:
    """Until ``pid`` has exited (a zombie counts: it no longer runs)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.02)
    raise AssertionError(f"worker {pid} still running {timeout_s} s after SIGKILL")


def test_worker_killed_while_idle_is_replaced() -> None:
    with MathReward(RewardConfig(num_workers=1, timeout_s=5.0)) as reward:
        assert reward([r"\boxed{1}"], ["1"]).statuses == [GradeStatus.CORRECT]
        (pid,) = reward.worker_pids()
        os.kill(pid, signal.SIGKILL)  # like the OOM killer between two RL steps
        _wait_dead(pid)  # "while idle": dead before the next call (a fixed sleep races under load)
        out = reward([r"\boxed{2}", r"\boxed{3}"], ["2", "4"])
        assert out.statuses == [GradeStatus.CORRECT, GradeStatus.WRONG]
        assert reward.worker_pids() != [pid] and reward.pool_events["started"] == 2

"""Final-answer extraction rules (pure string code, no math-verify)."""

from __future__ import annotations

import time

import pytest

from megatron_maspo.reward.extract import answer_line, extract_final_answer, last_boxed


@pytest.mark.parametrize(
    ("text", "span"),
    [
        (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\fbox{7}", "7"),
        (r"\boxed 5$", "5"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"\boxed{\frac{1}{2}", None),  # unbalanced
        ("no box", None),
    ],
)
def test_last_boxed(text: str, span: str | None) -> None:
    assert last_boxed(text, 100) == span


def test_answer_line_and_policies() -> None:
    text = "work...\nanswer: 3\nmore\nAnswer: $42$.\n"
    assert answer_line(text, 100) == "42"
    assert extract_final_answer(text, policy="boxed", max_chars=100) is None
    assert extract_final_answer(text, policy="boxed_or_answer_line", max_chars=100) == (
        "42",
        "answer_line",
    )
    assert extract_final_answer("the result is 9", policy="any", max_chars=100) == (
        "the result is 9",
        "tail",
    )
    assert extract_final_answer(r"Answer: 1 \boxed{2}", policy="any", max_chars=100) == (
        "2",
        "boxed",
    )
    with pytest.raises(ValueError, match="policy"):
        extract_final_answer("x", policy="last_number", max_chars=100)


def test_caps_bound_work_and_span() -> None:
    long_box = r"\boxed{" + "1" * 200 + "}"
    assert last_boxed(long_box, 100) is None
    nested = r"\boxed{" + "{" * 50_000 + "}" * 50_000 + "}"
    t0 = time.perf_counter()
    assert last_boxed(nested, 4096) is None
    huge = "x " * 500_000 + "Answer: 5"
    assert answer_line(huge, 4096) == "5"
    assert extract_final_answer("a" * 100_000, policy="any", max_chars=64)[0] == "a" * 64
    assert time.perf_counter() - t0 < 1.0

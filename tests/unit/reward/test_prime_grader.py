"""The evaluation grader's rules (reward/prime_grader.py): extraction order and equivalence."""

from __future__ import annotations

import pytest

from megatron_maspo.reward.base import GradeStatus
from megatron_maspo.reward.prime_grader import answers_match, extract_answer, grade_prime


@pytest.mark.parametrize("response, matched, text", [
    (r"so \boxed{\frac{1}{2}}", True, r"\frac{1}{2}"),
    ("Answer: 7", True, "7"),
    ("The answer is 7. Done", True, "7"),
    ("7 is the answer", True, "7"),
    (r"first \boxed{1} then \boxed{x = 4}", True, "4"),
    ("no digits here", False, "no digits here"),
])
def test_extraction_rules(response, matched, text):
    assert extract_answer(response) == (matched, text)


@pytest.mark.parametrize("given, gold, ok", [
    (r"\frac{1}{2}", r"\frac12", True),          # (a) MATH normalisation fixes \frac12
    ("12.0", "12", True),                         # (b) integer-valued float
    ("5 cm", "5", True),                          # (b) unit words dropped
    ("30^\\circ", "30", True),                    # (a) degrees
    ("(1, 2)", "(1,2)", True),                    # (c) tuple element-wise
    ("[1, 2)", "(1,2)", False),                   # (c) brackets must agree
    ("1/2", "2/4", True),                         # (c) rejects unequal fractions, (d) accepts the value
    (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}", True),  # (c) SymPy
    ("6.28", r"2\pi", True),                      # (d) π read as 3.14
    ("3.1416", r"\pi", True),                     # (d) relative 1e-4
    ("3.2", r"\pi", False),
    ("", "1", False),
])
def test_equivalence_rules(given, gold, ok):
    assert answers_match(given, gold) is ok


def test_grade_statuses():
    assert grade_prime(r"\boxed{2}", "2", "", 1024, 5.0) is GradeStatus.CORRECT
    assert grade_prime(r"\boxed{3}", "2", "", 1024, 5.0) is GradeStatus.WRONG
    assert grade_prime("I do not know", "2", "", 1024, 5.0) is GradeStatus.NO_ANSWER

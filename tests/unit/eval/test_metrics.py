"""Pass@k / Avg@k against hand-computed values and the exact binomial formula."""

from __future__ import annotations

import json
import math

import pytest

from megatron_maspo.eval.metrics import (
    avg_at_k,
    default_ks,
    pass_at_k,
    pass_at_k_single,
    render_json,
    render_table,
    summarize,
    table_ks,
)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (32, 1, 1, 0.03125),
        (32, 1, 8, 0.25),
        (32, 4, 4, 0.430617),
        (32, 16, 8, 0.998776),
        (32, 1, 32, 1.0),
        (32, 0, 8, 0.0),
        (4, 2, 2, 1 - 1 / 6),
        (5, 5, 1, 1.0),
    ],
)
def test_pass_at_k_hand_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k_single(n, c, k) == pytest.approx(expected, abs=1e-6)


def test_pass_at_k_matches_binomial_and_is_stable() -> None:
    for n in (1, 5, 16, 33):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k_single(n, c, k) == pytest.approx(exact, abs=1e-12)
    # Large n where C(n, k) overflows a float: still finite and in [0, 1].
    v = pass_at_k_single(5000, 3, 1000)
    assert v == pytest.approx(1 - math.comb(4997, 1000) / math.comb(5000, 1000), rel=1e-9)
    assert pass_at_k([0, 32, 1], 32, 1) == pytest.approx((0 + 1 + 1 / 32) / 3)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k_single(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k_single(4, 5, 1)


def test_avg_at_k_and_summary() -> None:
    assert avg_at_k([0, 4, 2], 4) == pytest.approx(0.5)
    assert avg_at_k([1, 3], 4) == pytest.approx(pass_at_k([1, 3], 4, 1))  # Avg@k = unbiased pass@1
    with pytest.raises(ValueError, match="c <= k"):
        avg_at_k([5], 4)
    assert default_ks(32) == list(range(1, 33)) and default_ks(6) == [1, 2, 3, 4, 5, 6]  # Pass@1..k
    assert table_ks(32) == [1, 2, 4, 8, 16, 32] and table_ks(6) == [1, 2, 4, 6]
    s = summarize({"a": [0, 4], "b": [2, 2, 2, 2]}, n=4, ks=[1, 4])
    assert s["a"] == {"avg@4": 0.5, "pass@1": 0.5, "pass@4": 0.5, "num_problems": 2.0, "num_dropped": 0.0}
    assert s["b"]["pass@4"] == 1.0 and s["b"]["pass@1"] == 0.5
    assert s["average"] == {"avg@4": 0.5, "pass@1": 0.5, "pass@4": 0.75, "num_problems": 6.0,
                            "num_dropped": 0.0}
    table = render_table(s)
    assert "| average | 50.00 | 50.00 | 75.00 | 6 | 0 |" in table.splitlines()
    assert "pass@1" not in render_table(s, ks=[4]) and "pass@4" in render_table(s, ks=[4])
    assert json.loads(render_json(s))["b"]["pass@4"] == 1.0

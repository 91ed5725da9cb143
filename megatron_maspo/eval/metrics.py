"""Evaluation maths: Avg@k and the unbiased Pass@k estimator (loss-formulas.md §16).

Inputs are per-problem correct counts ``num_correct_P`` out of ``n`` samples per problem.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence


def pass_at_k_single(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, arXiv 2107.03374).

    Computed as ``1 - Π_{i=n-c+1}^{n} (1 - k/i)``: a product of ``c`` factors in ``(0, 1]``, so no huge
    binomials and no cancellation between two large numbers.

    Args:
        n: samples drawn for the problem (``n >= k``).
        c: correct samples among them (``0 <= c <= n``).
        k: budget of the metric (``1 <= k <= n``).

    Raises:
        ValueError: ``k`` or ``c`` out of range.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:  # every size-k subset contains a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_at_k(num_correct_P: Sequence[int], n: int, k: int) -> float:
    """Mean unbiased pass@k over problems (loss-formulas.md §16.2); 0.0 for an empty set."""
    if not num_correct_P:
        return 0.0
    return math.fsum(pass_at_k_single(n, c, k) for c in num_correct_P) / len(num_correct_P)


def avg_at_k(num_correct_P: Sequence[int], k: int) -> float:
    """Avg@k = mean over problems of ``c_j / k`` (loss-formulas.md §16.1): per-sample accuracy.

    Raises:
        ValueError: a count outside ``0..k``.
    """
    if not num_correct_P:
        return 0.0
    bad = next((c for c in num_correct_P if not 0 <= c <= k), None)
    if bad is not None:
        raise ValueError(f"avg@k needs 0 <= c <= k={k}, got c={bad}")
    return math.fsum(c / k for c in num_correct_P) / len(num_correct_P)


def default_ks(n: int) -> list[int]:
    """Every budget 1..n: the Pass@k curve of MASPO Fig. 3 / Table 7 (n = 32 there)."""
    return list(range(1, n + 1))


def table_ks(n: int) -> list[int]:
    """The budgets shown in the console table: powers of two up to ``n``, plus ``n``."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else [*ks, n]


def summarize(
    num_correct: Mapping[str, Sequence[int]], n: int, ks: Sequence[int] | None = None,
    dropped: Mapping[str, int] | None = None,
) -> dict[str, dict[str, float]]:
    """Per-benchmark metrics and their unweighted mean over benchmarks.

    Args:
        num_correct: benchmark name -> ``[P]`` correct counts out of ``n``.
        n: samples per problem.
        ks: Pass@k budgets (default: :func:`default_ks`).
        dropped: benchmark name -> problems not evaluated (prompt over the length budget); reported
            as ``num_dropped`` (they are in ``num_correct`` already if the caller scores them wrong).

    Returns:
        ``{name: {"avg@n": ..., "pass@1": ..., ..., "num_problems": P}, "average": {...}}``; the average
        row is the mean of the benchmark rows (each benchmark counts once, as papers report it).
    """
    ks = list(ks) if ks is not None else default_ks(n)
    table: dict[str, dict[str, float]] = {}
    for name, counts in num_correct.items():
        row = {f"avg@{n}": avg_at_k(counts, n)}
        row.update({f"pass@{k}": pass_at_k(counts, n, k) for k in ks})
        row["num_problems"] = float(len(counts))
        row["num_dropped"] = float((dropped or {}).get(name, 0))
        table[name] = row
    if table:
        counts_keys = ("num_problems", "num_dropped")
        keys = [k for k in next(iter(table.values())) if k not in counts_keys]
        avg = {k: math.fsum(r[k] for r in table.values()) / len(table) for k in keys}
        for c in counts_keys:
            avg[c] = float(sum(r[c] for r in table.values()))
        table["average"] = avg
    return table


def render_table(summary: Mapping[str, Mapping[str, float]], ks: Sequence[int] | None = None) -> str:
    """Markdown table: one row per benchmark (then ``average``), metrics in percent.

    ``ks`` limits the Pass@k columns (the JSON report keeps every k); default: all.
    """
    if not summary:
        return "(no benchmarks)"
    cols = list(next(iter(summary.values())))
    if ks is not None:
        keep = {f"pass@{k}" for k in ks}
        cols = [c for c in cols if not c.startswith("pass@") or c in keep]
    lines = ["| benchmark | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, row in summary.items():
        cells = [f"{int(row[c])}" if c.startswith("num_") else f"{100 * row[c]:.2f}" for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_json(summary: Mapping[str, Mapping[str, float]]) -> str:
    """The summary as sorted, indented JSON (fractions in [0, 1], not percent)."""
    return json.dumps(summary, indent=2, sort_keys=True)

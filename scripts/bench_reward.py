"""Grading throughput of the math reward: 1 worker vs N workers, interleaved, as a ratio.

    python scripts/bench_reward.py                      # 512 items, N = os.cpu_count(), 3 rounds
    python scripts/bench_reward.py --items 2048 --workers 4 --rounds 5 --json

Items are realistic responses (fractions, radicals, intervals, sets, "Answer:" lines; ~1/3 wrong) against
their gold answers. Pools are started and warmed before timing; rounds alternate 1-worker and N-worker
runs so machine noise hits both equally. Reports median items/s of each and the speed-up ratio, plus an
in-process baseline (``grade_math`` called directly, no pool) that shows the pool's IPC overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from megatron_maspo.reward import RewardConfig
from megatron_maspo.reward.math_reward import MathReward
from megatron_maspo.reward.math_verify import grade_math

_PAIRS = [
    (r"so the answer is $\boxed{{\frac{{{a}}}{{{b}}}}}$.", "{a}/{b}"),
    (r"\boxed{{{a}\sqrt{{{b}}}}}", r"\sqrt{{{a2b}}}"),
    (r"Therefore $x \in \boxed{{[{a}, {b})}}$", "[{a},{b})"),
    (r"\boxed{{\{{{a},{b}\}}}}", r"\{{{b},{a}\}}"),
    ("Step 1 ... Step 9.\nAnswer: {s}", "{s}"),
    (r"\boxed{{{a}.{b}}}", "{a}.{b}"),
]


def make_items(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``n`` (response, gold) pairs; every third response is perturbed to be wrong."""
    rng = random.Random(seed)
    responses, golds = [], []
    for i in range(n):
        a, b = rng.randint(1, 99), rng.randint(100, 999)
        resp, gold = rng.choice(_PAIRS)
        fmt = {"a": a, "b": b, "s": a + b, "a2b": a * a * b}
        response = "Let me think step by step. " * rng.randint(1, 40) + resp.format(**fmt)
        responses.append(response.replace(str(a), str(a + 1), 1) if i % 3 == 0 else response)
        golds.append(gold.format(**fmt))
    return responses, golds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, default=512)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = p.parse_args()
    responses, golds = make_items(args.items)
    pools = {
        w: MathReward(RewardConfig(num_workers=w, timeout_s=10.0))
        for w in sorted({1, args.workers})
    }
    try:
        for r in pools.values():  # warm every worker (start-up and math-verify's lazy init)
            r(responses[: 4 * args.workers], golds[: 4 * args.workers])
        rates: dict[int, list[float]] = {w: [] for w in pools}
        inproc: list[float] = []
        correct = None
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for resp, gold in zip(responses, golds):
                grade_math(resp, gold, "boxed_or_answer_line", 4096, 10.0)
            inproc.append(args.items / (time.perf_counter() - t0))
            for w, reward in pools.items():
                t0 = time.perf_counter()
                out = reward(responses, golds)
                rates[w].append(args.items / (time.perf_counter() - t0))
                assert correct is None or out.correct == correct, (
                    "grading differs between pool sizes"
                )
                correct = out.correct
    finally:
        for r in pools.values():
            r.close()
    med = {w: statistics.median(v) for w, v in rates.items()}
    result = {
        "items": args.items,
        "rounds": args.rounds,
        "cpu_count": os.cpu_count(),
        "workers": args.workers,
        "items_per_s_1": med[1],
        f"items_per_s_{args.workers}": med[args.workers],
        "speedup": med[args.workers] / med[1],
        "items_per_s_inproc": statistics.median(inproc),
        "pool1_vs_inproc": med[1] / statistics.median(inproc),
        "correct_frac": sum(correct) / len(correct),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"1 worker: {med[1]:.1f} items/s | {args.workers} workers: {med[args.workers]:.1f} items/s "
            f"| speed-up {result['speedup']:.2f}x | 1-worker pool / in-process {result['pool1_vs_inproc']:.2f} ({args.items} items, median of {args.rounds} rounds, "
            f"{result['correct_frac']:.0%} correct)"
        )


if __name__ == "__main__":
    main()

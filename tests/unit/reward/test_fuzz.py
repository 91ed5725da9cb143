"""Fuzz the grader with random and mutated strings: no crash, no hang, bounded worker memory."""

from __future__ import annotations

import random
import time

import psutil
import pytest

from megatron_maspo.reward import GradeStatus, RewardConfig
from megatron_maspo.reward.math_reward import MathReward
from tests.unit.reward.test_math_reward import TABLE

_TOKENS = [
    "\\boxed{",
    "\\frac{",
    "}",
    "{",
    "\\sqrt",
    "^",
    "_",
    "\\left(",
    "\\right)",
    "[",
    "]",
    "(",
    ")",
    "\\{",
    "\\}",
    "9",
    "0",
    "1",
    ".",
    ",",
    "-",
    "+",
    "*",
    "/",
    "=",
    "x",
    "\\pi",
    "\\infty",
    "\\%",
    "\\text{cm}",
    "$",
    "\\\\",
    "\\begin{pmatrix}",
    "&",
    "Answer: ",
    "\n",
    " ",
    "\\cdot",
    "!",
    "e",
    "\\int",
    "\\sum_{",
    "\\ln",
    "\x00",
    "é",
    "∞",
    "\\,",
    "\\dfrac",
    "^{9^{9}}",
]


def _fuzz_strings(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    golds = [g for _, g, _ in TABLE]
    out = []
    for i in range(n):
        if i % 2:
            text = "".join(rng.choice(_TOKENS) for _ in range(rng.randint(0, 40)))
        else:  # mutate a real response: insert / delete / replace a few tokens
            chars = list(rng.choice(TABLE)[0])
            for _ in range(rng.randint(1, 6)):
                op, pos = rng.random(), rng.randint(0, len(chars))
                if op < 0.4:
                    chars.insert(pos, rng.choice(_TOKENS))
                elif op < 0.7 and chars:
                    del chars[min(pos, len(chars) - 1)]
                elif chars:
                    chars[min(pos, len(chars) - 1)] = rng.choice(_TOKENS)
            text = "".join(chars)
        out.append((text, rng.choice(golds)))
    return out


def _fuzz(n: int, seed: int, time_limit_s: float) -> None:
    # fallback="any" hands whole (capped) strings to the parser: the widest attack surface.
    cfg = RewardConfig(num_workers=2, timeout_s=5.0, max_worker_rss_mb=600, fallback="any")
    with MathReward(cfg) as reward:
        pairs = _fuzz_strings(n, seed)
        t0 = time.perf_counter()
        peak_rss_mb = 0.0
        for start in range(0, n, 250):  # batches like RL steps; sample worker RSS between them
            chunk = pairs[start : start + 250]
            out = reward([p for p, _ in chunk], [g for _, g in chunk])
            assert len(out.rewards) == len(chunk)
            assert set(out.rewards) <= {1.0, -1.0}
            assert all(isinstance(s, GradeStatus) for s in out.statuses)
            assert out.metrics["reward/crash_count"] == 0
            for pid in reward.worker_pids():
                peak_rss_mb = max(peak_rss_mb, psutil.Process(pid).memory_info().rss / 2**20)
        elapsed = time.perf_counter() - t0
        assert elapsed < time_limit_s, elapsed
        assert peak_rss_mb < cfg.max_worker_rss_mb, peak_rss_mb
        assert reward.totals.total() == n
        # Nearly everything grades in time; a few pathological mutations may hit the deadline.
        assert reward.totals["timeout"] <= n // 100


def test_fuzz_default() -> None:
    # ~9 s on an idle 2-core box; the bound only catches a hang (an oversubscribed CI box is slower).
    _fuzz(3000, seed=0, time_limit_s=240.0)


@pytest.mark.slow
def test_fuzz_large() -> None:
    _fuzz(20_000, seed=1, time_limit_s=1200.0)

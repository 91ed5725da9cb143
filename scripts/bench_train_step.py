"""Training throughput of the tiny Qwen2-style model on CPU: TP=1 vs TP=2 (for the record).

Runs two 2-rank gloo worlds with the same global batch: TP=1 x DP=2 and TP=2 x DP=1, alternating
(``--rounds``) so machine noise hits both; prints trained response tokens/s per layout and the
TP2/TP1 ratio.

    OMP_NUM_THREADS=1 python scripts/bench_train_step.py --rounds 3 --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# the tiny model, configs and samples live in the test helpers; make the repo root importable
# (also in the spawned ranks, which re-import this file)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _worker(rank: int, world: int, tp: int, steps: int) -> float:
    from tests.distributed import _actor_helpers as H

    actor = H.build_actor(world, tp=tp, budget=256, mini_batches=2)
    samples = H.make_samples(n_prompts=8, group=4)
    actor.train_step(samples)  # warm-up
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        m = actor.train_step(samples)
        tokens += sum(len(s.response_ids) for s in samples) - m["actor/truncated_tokens"]
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    from megatron_maspo.parallel.launch import run_workers

    rates: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for tp in (1, 2):
            rates[tp].append(run_workers(_worker, 2, tp, args.steps)[0])
    for tp in (1, 2):
        print(f"TP={tp} (2 ranks): median {statistics.median(rates[tp]):.0f} trained tokens/s "
              f"(rounds: {', '.join(f'{r:.0f}' for r in rates[tp])})")
    print(f"ratio TP2/TP1: {statistics.median(rates[2]) / statistics.median(rates[1]):.2f}")


if __name__ == "__main__":
    main()

"""The README's "learns" figure from a run's metrics: mean reward of the last K steps minus the first K.

    maspo train --set train.seed=2 --set checkpoint.run_dir=runs/seed2
    python scripts/reward_gain.py runs/seed2 [runs/seed3 ...] [--k 10]

Prints one line per run (gain, steps, wall time from the metrics' timings) and, with several runs, their
mean. Reads ``metrics.jsonl`` only (RL steps; the supervised warm start is not in it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def reward_gain(rewards: list[float], k: int) -> float:
    """``mean(rewards[-k:]) - mean(rewards[:k])``; needs at least ``2k`` steps so the windows do not overlap."""
    if len(rewards) < 2 * k:
        raise ValueError(f"need at least {2 * k} steps for k={k}, got {len(rewards)}")
    return sum(rewards[-k:]) / k - sum(rewards[:k]) / k


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files)")
    p.add_argument("--k", type=int, default=10, help="window in steps (default 10)")
    args = p.parse_args(argv)
    gains = []
    for run in args.runs:
        path = Path(run) / "metrics.jsonl" if Path(run).is_dir() else Path(run)
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
        gain = reward_gain(rewards, args.k)
        gains.append(gain)
        print(f"{run}: gain {gain:+.2f} over {len(rewards)} steps (first {args.k}: "
              f"{sum(rewards[:args.k]) / args.k:+.3f}, last {args.k}: {sum(rewards[-args.k:]) / args.k:+.3f})")
    if len(gains) > 1:
        print(f"mean gain {sum(gains) / len(gains):+.2f} over {len(gains)} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Compare two runs' metrics.jsonl row by row, timings aside: did a refactor change behaviour?

    python scripts/compare_metrics.py runs/before/metrics.jsonl runs/after/metrics.jsonl
    python scripts/compare_metrics.py runs/colocated/metrics.jsonl runs/disagg/metrics.jsonl --placement

``--placement`` also skips what differs between a colocated and a disaggregated run by design: ``sync/*``,
``rollout/engine*``, ``rollout/prompts_per_engine*`` and ``rollout/engine_busy_s``.

Every key is compared exactly except the wall-clock ones (``megatron_maspo.train.observe.timing_keys``:
``time/*``, ``memory/*``, rates, ``sync/*_s`` durations; they depend on the machine's load). Prints each
difference and a closing count; exits 1 when any differ.
"""

from __future__ import annotations

import json
import sys

from megatron_maspo.train.observe.timing_keys import is_timing

PLACEMENT_KEYS = ("sync/", "rollout/engine", "rollout/prompts_per_engine")


def _skip(key: str, placement: bool = False) -> bool:
    return is_timing(key) or (placement and key.startswith(PLACEMENT_KEYS))


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def compare(a_path: str, b_path: str, *, placement: bool = False) -> int:
    a, b = _rows(a_path), _rows(b_path)
    diffs = 0 if len(a) == len(b) else 1
    if diffs:
        print(f"row counts differ: {len(a)} vs {len(b)}")
    for i, (x, y) in enumerate(zip(a, b)):
        kx = {k for k in x if not _skip(k, placement)}
        ky = {k for k in y if not _skip(k, placement)}
        if kx != ky:
            print(f"row {i}: keys differ: {sorted(kx ^ ky)}")
            diffs += 1
        for k in sorted(kx & ky):
            if x[k] != y[k]:
                print(f"row {i}: {k}: {x[k]!r} vs {y[k]!r}")
                diffs += 1
    print(f"{min(len(a), len(b))} rows compared, {diffs} differences")
    return 1 if diffs else 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--placement"]
    sys.exit(compare(args[0], args[1], placement="--placement" in sys.argv[1:]))

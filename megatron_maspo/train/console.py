"""One console line per step, and a progress bar over steps (rank 0 only)."""

from __future__ import annotations

import sys

KEYS = (("reward/mean", "reward", "{:+.3f}"), ("reward/accuracy", "acc", "{:.2f}"),
        ("entropy/mean", "ent", "{:.3f}"), ("response_length/mean", "len", "{:.1f}"),
        ("actor/grad_norm", "gnorm", "{:.3f}"), ("time/step", "s", "{:.1f}"))


class StepPrinter:
    """Prints ``step k/N | reward +0.123 | acc 0.45 | ...`` lines."""

    def __init__(self, rank: int, total: int, *, enabled: bool = True) -> None:
        self.rank, self.total, self.enabled = rank, total, enabled

    def print(self, step: int, metrics: dict[str, float]) -> None:
        if self.rank != 0 or not self.enabled:
            return
        parts = [f"step {step + 1:>4d}/{self.total}"]
        for key, label, fmt in KEYS:
            if metrics.get(key) is not None:
                parts.append(f"{label} {fmt.format(metrics[key])}")
        gate = next((k for k in metrics if k.endswith("w_mean") or k.endswith("gate_mean")), None)
        if gate:
            parts.append(f"{gate} {metrics[gate]:.3f}")
        print(" | ".join(parts), file=sys.stdout, flush=True)

"""The one console line per RL step (rank 0 only); ``train/observe/progress.py`` draws the bars."""

from __future__ import annotations

import sys

KEYS = (("reward/mean", "reward", "{:+.3f}"), ("reward/accuracy", "acc", "{:.2f}"),
        ("entropy/mean", "ent", "{:.3f}"), ("response_length/mean", "len", "{:.1f}"),
        ("actor/grad_norm", "gnorm", "{:.3f}"), ("time/step", "s", "{:.1f}"))


class StepPrinter:
    """Formats ``step k/N | reward +0.123 | acc 0.45 | ...`` lines; ``k`` counts from 1 (steps done)."""

    def __init__(self, rank: int, total: int, *, enabled: bool = True) -> None:
        self.rank, self.total, self.enabled = rank, total, enabled

    def format(self, step: int, metrics: dict[str, float]) -> str | None:
        """The line for the state after ``step`` updates; None off rank 0 or when disabled."""
        if self.rank != 0 or not self.enabled:
            return None
        parts = [f"step {step:>4d}/{self.total}"]
        for key, label, fmt in KEYS:
            if metrics.get(key) is not None:
                parts.append(f"{label} {fmt.format(metrics[key])}")
        gate = next((k for k in metrics if k.endswith("w_mean") or k.endswith("gate_mean")), None)
        if gate:
            parts.append(f"{gate} {metrics[gate]:.3f}")
        return " | ".join(parts)

    def print(self, step: int, metrics: dict[str, float]) -> None:
        line = self.format(step, metrics)
        if line is not None:
            print(line, file=sys.stdout, flush=True)

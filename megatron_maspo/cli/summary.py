"""The lines ``maspo train`` prints when a run ends: what happened, where it is, what to run next."""

from __future__ import annotations

import json
import shlex
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    """Training rows of ``metrics.jsonl`` (held-out ``eval/*`` rows and broken lines left out)."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "reward/mean" in row:
                rows.append(row)
    return rows


def _trend(rows: list[dict], key: str, fmt: str) -> str | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    if not vals:
        return None
    return f"{vals[0]:{fmt}} -> {vals[-1]:{fmt}}" if len(vals) > 1 else f"{vals[0]:{fmt}}"


def run_summary(run_dir: str | Path, seconds: float) -> list[str]:
    """Summary lines of the run in ``run_dir`` that took ``seconds`` (rank 0 prints them)."""
    run = Path(run_dir)
    rows = _rows(run / "metrics.jsonl")
    out = []
    if rows:
        steps = f"steps {rows[0]['step']}-{rows[-1]['step']}" if len(rows) > 1 else f"step {rows[0]['step']}"
        parts = [f"{steps} in {seconds / 60:.1f} min"]
        for key, name, fmt in (("reward/mean", "reward", "+.3f"), ("reward/accuracy", "accuracy", ".2f")):
            if (t := _trend(rows, key, fmt)) is not None:
                parts.append(f"{name} {t}")
        out.append("done: " + ", ".join(parts) + " (first -> last step)")
    where = [("metrics", run / "metrics.jsonl"), ("plots", run / "plots"), ("TensorBoard", run / "tb"),
             ("checkpoints", run / "checkpoints")]
    for name, path in where:
        if path.exists():
            hint = f"  (tensorboard --logdir {shlex.quote(str(path))})" if name == "TensorBoard" else ""
            out.append(f"  {name + ':':<13}{path}{hint}")
    q = shlex.quote(str(run))
    if (run / "checkpoints").is_dir():
        out.append(f"  {'continue:':<13}maspo train --resume {q} --set train.steps=N")
        out.append(f"  {'evaluate:':<13}maspo eval {q}")
    return out

"""``scripts/reward_gain.py``, the command behind the README's "learns" figure, on a hand-made metrics file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reward_gain.py"


def test_gain_is_last_window_minus_first(tmp_path):
    rows = [{"step": i, "reward/mean": i / 10} for i in range(25)] + [{"step": 25, "other": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--k", "5"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # first 5: 0.0..0.4 (mean 0.2); last 5: 2.0..2.4 (mean 2.2)
    assert "gain +2.00 over 25 steps" in r.stdout


def test_too_short_run_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"reward/mean": 0.5}) + "\n")
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert r.returncode != 0 and "need at least 20 steps" in r.stderr

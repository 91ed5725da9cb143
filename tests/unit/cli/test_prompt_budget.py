"""A prompt set with no prompt inside ``data.max_prompt_tokens`` is refused in one line, with the tokenizer
only (no model build), and leaves no run directory behind (a real ``maspo train`` process)."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def test_no_prompt_within_the_budget_is_one_line_before_the_model_and_leaves_no_folder(tmp_path):
    run = tmp_path / "run"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", "train", "--set",
                        "data.max_prompt_tokens=4", "--set", f"checkpoint.run_dir={run}"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    elapsed = time.monotonic() - t0
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [
        "maspo train: error: data.source='synthetic': no usable row (skipped: {'too_long': 200}); every "
        "prompt is over data.max_prompt_tokens=4"], r.stderr[-3000:]
    assert not run.exists()
    assert elapsed < 30, elapsed  # megatron-core is not imported, no model is built (measured: 0.7 s)

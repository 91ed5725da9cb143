"""The distributed suite again, under the GPU-semantics emulation (``MASPO_EMULATE_GPU=1``,
docs/gpu-emulation.md): TP/PP/DP/EP/CP, the vocab-parallel maths, the weight sync, the fleet and the pool
bridge must hold with streams, host reads, the posting order and the GPU backends checked.

Slow (about as long as the default distributed tests themselves): one pytest in a subprocess, whose
worker pools start under the emulation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_distributed_suite_passes_under_gpu_emulation():
    env = {**os.environ, "MASPO_EMULATE_GPU": "1", "MASPO_EMULATE_GPU_TIMEOUT_S": "120", "OMP_NUM_THREADS": "1"}
    here = Path(__file__).name
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow and not gpu",
           str(ROOT / "tests" / "distributed"), "--deselect", f"tests/distributed/{here}",
           "--deselect", "tests/distributed/test_gpu_emulation.py"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout.splitlines()[-1], r.stdout[-2000:]

"""2-rank ``maspo train`` under torchrun (gloo) with a fault injected on rank 1 at step 2 (MASPO_FAULT).

- an exception: the job exits non-zero within seconds of the fault (not the 30-minute collective
  timeout) and prints rank 1's traceback;
- NaN log-probs with ``loss.nonfinite=skip``: step 2's optimizer steps are skipped on both ranks and
  training runs to the end;
- NaN log-probs with ``loss.nonfinite=raise``: every rank raises together and the job ends.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_train_cli import MICRO

pytestmark = pytest.mark.slow  # each run starts 2 ranks of the trainer: ~40 s on 2 shared cores


def _torchrun(run_dir: Path, fault: str, *sets: str) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_maspo.cli.main", "train"]
    for s in [*MICRO, "train.steps=4", f"checkpoint.run_dir={run_dir}", *sets]:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASPO_FAULT": fault}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    return out, time.time()


def test_exception_on_one_rank_ends_the_job_with_its_traceback(tmp_path):
    out, ended = _torchrun(tmp_path / "run", "rank=1,step=2,kind=raise")
    assert out.returncode != 0
    err = out.stderr
    assert "[rank 1] megatron_maspo.train.process.faults.InjectedFault" in err, err[-4000:]
    assert "[rank 1]   File" in err  # the traceback itself, prefixed with the rank
    injected = float(re.search(r"injected exception on rank 1 at step 2 \(unix time ([\d.]+)\)",
                               err).group(1))
    assert ended - injected < 60, f"job ended {ended - injected:.0f} s after the fault"
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]  # step 1 finished; step 2 failed on rank 1


def test_nan_with_skip_skips_that_step_on_both_ranks_and_continues(tmp_path):
    out, _ = _torchrun(tmp_path / "run", "rank=1,step=2,kind=nan", "loss.nonfinite=skip")
    assert out.returncode == 0, out.stderr[-4000:]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    skipped = [r["actor/steps_skipped"] for r in recs]
    assert skipped[1] > 0 and skipped[0] == skipped[2] == skipped[3] == 0, skipped  # step 2 only
    for rank in (0, 1):
        assert f"skipped on rank {rank}" in out.stderr
    assert (tmp_path / "run" / "checkpoints" / "step_4").is_dir()


def test_nan_with_raise_raises_on_every_rank(tmp_path):
    out, _ = _torchrun(tmp_path / "run", "rank=1,step=2,kind=nan", "loss.nonfinite=raise")
    assert out.returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] FloatingPointError: non-finite log-probs" in out.stderr, out.stderr[-4000:]

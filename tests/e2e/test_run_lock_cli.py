"""Two ``maspo train`` runs into one run directory (real runs): the second is refused in one line naming
the first's host and pid before it writes anything there; the first finishes with its own config and
each step logged once; after a SIGKILL of a run, ``--resume`` of it is not refused; ``maspo eval`` of a
run still training reads a checkpoint even when the trainer prunes it during the eval's model build."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from megatron_maspo.train.process.run_lock import LOCK_NAME
from tests.e2e.test_train_cli import MICRO, _cmd, _metrics, _run

pytestmark = pytest.mark.slow  # four micro runs and an eval: ~70 s on 2 shared cores


def _wait(cond, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_a_second_run_is_refused_and_the_first_stays_whole(tmp_path):
    run = tmp_path / "same"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sets = [*MICRO, "train.steps=3", f"checkpoint.run_dir={run}"]
    first = subprocess.Popen(_cmd(sets=[*sets, "train.seed=1"]), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait(lambda: (run / LOCK_NAME).exists(), first, 120)
        second = _run(sets=[*sets, "train.seed=2"])
        assert second.returncode == 2, second.stderr[-3000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) <= 3 and lines[-1].startswith(
            f"maspo train: error: run directory {run} is in use by pid {first.pid} on this host"), lines
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, err[-3000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["seed"] == 1
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3]
    assert not (run / LOCK_NAME).exists()  # released at the end


def test_resume_after_sigkill_is_not_refused(tmp_path):
    run = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(_cmd(sets=[*MICRO, "train.steps=50", "checkpoint.save_every=1",
                                    f"checkpoint.run_dir={run}"]),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait(lambda: (run / "checkpoints" / "step_1").is_dir(), p, 240)
    finally:
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
    assert (run / LOCK_NAME).exists()  # a SIGKILL leaves it behind
    r = _run("--resume", str(run), sets=["train.steps=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"taking over the lock of pid {p.pid}" in r.stderr
    assert not list((run / "checkpoints").glob(".tmp_step_*"))  # the killed run's partial save is gone


def test_eval_of_a_running_run_reads_a_checkpoint_the_trainer_prunes(tmp_path):
    # save_every=1 and keep_last=2: a checkpoint lives about one step, less than eval's model build
    run = tmp_path / "live"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(_cmd(sets=[*MICRO, "train.steps=40", "checkpoint.save_every=1",
                                    f"checkpoint.run_dir={run}"]),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait(lambda: (run / "checkpoints" / "step_2").is_dir(), p, 240)
        r = subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", "eval", str(run), "--k", "1",
                            "--num-problems", "2"], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "checkpoint: " in r.stdout
        _, err = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 0, err[-3000:]
    assert [r["step"] for r in _metrics(run)] == list(range(1, 41))
    assert not list((run / "checkpoints").glob(".pinned-*"))  # the snapshot went with the eval

"""SIGKILL of ``maspo train`` leaves no process of the run behind (counted by session id, 20 s later).

The run starts in its own session, so every process it starts (grading pool and its fork server,
Megatron-Core's checkpoint writers and their Manager, the resource tracker) shares the session id
unless it calls ``setsid`` itself. Killed once right after a checkpoint, once while a save is running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.test_train_cli import MICRO

pytestmark = pytest.mark.slow  # a micro run each, plus the 20 s wait


def _session(sid: int) -> list[str]:
    alive = []
    for p in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(f"{p.pid} {' '.join(p.info['cmdline'] or [p.info['name']])[:120]}")
        except (ProcessLookupError, psutil.Error, PermissionError):
            continue
    return alive


def _start(run: Path, steps: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_maspo.cli.main", "train"]
    for s in [*MICRO, f"train.steps={steps}", "checkpoint.save_every=1", f"checkpoint.run_dir={run}"]:
        cmd += ["--set", s]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_for(cond, timeout_s: float, poll_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "the run did not get there in time"
        time.sleep(poll_s)


def _kill_and_count(proc: subprocess.Popen) -> list[str]:
    sid = proc.pid  # start_new_session: the trainer leads its session
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(20)
    left = _session(sid)
    for line in left:  # clean up for the next test, then report
        os.kill(int(line.split()[0]), signal.SIGKILL)
    return left


def test_sigkill_after_a_checkpoint_leaves_nothing(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, steps=50)
    _wait_for(lambda: (run / "checkpoints" / "step_1").is_dir(), 240, 0.2)
    time.sleep(1.0)  # between saves: the writers' Manager and the grading pool are up
    assert _kill_and_count(proc) == []


def test_sigkill_during_a_save_leaves_nothing(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, steps=50)
    _wait_for(lambda: (run / "checkpoints" / "step_1").is_dir(), 240, 0.2)
    # the next save's temporary folder: killed while Megatron's writers run
    _wait_for(lambda: any((run / "checkpoints").glob(".tmp_step_2.*")), 120, 0.005)
    assert _kill_and_count(proc) == []

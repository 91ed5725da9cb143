"""The run-directory lock (``train/process/run_lock.py``) with real processes and files: a live holder is refused
in one line naming its host and pid, a killed one's lock is taken over with a warning, a pid reused by
another process or an earlier Slurm incarnation counts as gone, another host's lock is refused."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_maspo.train.process.run_lock import (
    LOCK_NAME,
    RunDirLockedError,
    acquire,
    release,
    run_dir_lock,
)

_HOLD = ("import sys, time; from megatron_maspo.train.process.run_lock import acquire; acquire(sys.argv[1]); "
         "print('held', flush=True); time.sleep(60)")


def _holder(run_dir: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _plant(run_dir: Path, **rec) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / LOCK_NAME
    lock.write_text(json.dumps({"host": socket.gethostname(), "started": "2026-01-01 00:00:00 UTC", **rec}))
    return lock


def test_a_live_holder_is_refused_in_one_line_then_its_sigkill_frees_the_directory(tmp_path, caplog):
    run = tmp_path / "run"
    p = _holder(run)
    try:
        with pytest.raises(RunDirLockedError) as e:
            acquire(run)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"run directory {run} is in use by pid {p.pid} on this host"), msg
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    with caplog.at_level(logging.WARNING):
        lock = acquire(run)  # the killed holder's lock is taken over
    assert f"taking over the lock of pid {p.pid}" in caplog.text
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    release(lock)
    assert not lock.exists()


def test_a_reused_pid_counts_as_gone_and_another_host_does_not(tmp_path):
    # our own pid is alive, but with another start time it is a different process than the one that locked
    lock = _plant(tmp_path / "a", pid=os.getpid(), proc_start="other-boot:1")
    assert acquire(tmp_path / "a") == lock
    _plant(tmp_path / "b", pid=_dead_pid(), host="node-17")  # cannot be checked from here
    with pytest.raises(RunDirLockedError, match=r"in use by pid \d+ on host node-17 .*if that run is gone, "
                                                f"delete {tmp_path / 'b' / LOCK_NAME}"):
        acquire(tmp_path / "b")


def test_a_slurm_job_requeued_onto_another_node_takes_its_own_lock_back(tmp_path, monkeypatch):
    _plant(tmp_path, pid=1, host="node-1", slurm=["4242", "0"])
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    acquire(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "4343")  # another job: refused
    _plant(tmp_path / "x", pid=1, host="node-1", slurm=["4242", "0"])
    with pytest.raises(RunDirLockedError, match="node-1"):
        acquire(tmp_path / "x")


def test_an_empty_lock_left_by_a_kill_between_create_and_write_is_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text("")
    assert json.loads(acquire(tmp_path).read_text())["pid"] == os.getpid()


def test_only_rank_0_holds_the_lock_and_releases_it_on_error(tmp_path):
    with run_dir_lock(tmp_path, rank=1) as lock:
        assert lock is None and not (tmp_path / LOCK_NAME).exists()
    with pytest.raises(RuntimeError), run_dir_lock(tmp_path, rank=0) as lock:
        assert lock.exists()
        raise RuntimeError("the run failed")
    assert not (tmp_path / LOCK_NAME).exists()
    fresh = tmp_path / "fresh"  # created by the lock, refused before any write: no empty folder left
    with pytest.raises(RuntimeError), run_dir_lock(fresh, rank=0):
        raise RuntimeError("refused by a preflight check")
    assert not fresh.exists() and tmp_path.exists()


def test_racing_starters_on_a_stale_lock_get_one_winner(tmp_path):
    _plant(tmp_path, pid=_dead_pid())
    release = tmp_path / "release"
    # all start at one instant; the winner holds the lock until the test has every answer
    code = ("import os, sys, time; from megatron_maspo.train.process.run_lock import acquire, RunDirLockedError\n"
            "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"
            "try:\n    acquire(sys.argv[1]); print('won', flush=True)\n"
            "    end = time.time() + 60\n"
            "    while not os.path.exists(sys.argv[3]) and time.time() < end: time.sleep(0.05)\n"
            "except RunDirLockedError:\n    print('refused', flush=True)")
    start = time.time() + 3.0
    ps = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(start), str(release)],
                           stdout=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        outs = sorted(p.stdout.readline().strip() for p in ps)
    finally:
        release.write_text("x")
        for p in ps:
            p.wait(timeout=60)
    assert outs == ["refused", "refused", "refused", "won"], outs

def test_a_run_directory_that_cannot_be_written_is_one_storage_line(tmp_path):
    from megatron_maspo.errors import StorageError

    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(StorageError, match=rf"^run directory {tmp_path / 'file' / 'run'} is not writable"):
        acquire(tmp_path / "file" / "run")


def test_the_lock_rank_comes_from_torchrun_or_an_srun_native_task(monkeypatch):
    from megatron_maspo.cli.train import job_rank

    for k in ("RANK", "WORLD_SIZE", "MASPO_RANKS_FROM_SLURM"):
        monkeypatch.delenv(k, raising=False)
    assert job_rank() == 0  # one process
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert job_rank() == 2  # torchrun
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("MASPO_RANKS_FROM_SLURM", "1")
    for k, v in (("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "1"),
                 ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(k, v)
    assert job_rank() == 3  # srun-native: every task would otherwise take itself for rank 0

"""``maspo launch --executor slurm`` against a real one-node Slurm cluster (tests/slurm/conftest.py).

Every job is the MICRO tiny recipe on 2 srun tasks (DP 2, gloo, CPU). The submit test runs in CI; the
preemption and failure tests take a few minutes each on 2 cores and are ``slow``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_maspo.config import load_config
from tests.slurm.conftest import (
    REPO,
    comparable,
    launch,
    metrics,
    record,
    scontrol_job,
    squeue_ids,
    wait_done,
)

pytestmark = [pytest.mark.slurm, pytest.mark.launch]


def _show(env, tmp: Path, name: str, flag: str) -> str:
    r = subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", "launch", flag, "--name", name,
                        "--job-dir", str(tmp / "jobs")], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _submit(env, tmp: Path, name: str, *sets: str, **kw) -> tuple[str, Path]:
    r = launch(env, tmp, name, *sets, **kw)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rec = record(tmp, name)
    assert f"submitted Slurm job {rec['job_id']}" in r.stdout
    return rec["job_id"], Path(rec["run_dir"])


def test_submit_tiny_recipe_dp2(slurm_env, tmp_path):
    """sbatch + 2 srun tasks find each other (MASTER_ADDR from the allocation), train, and finish."""
    job_id, run_dir = _submit(slurm_env, tmp_path, "dp2", "train.steps=2")
    job = wait_done(slurm_env, job_id, timeout=600)
    logs = _show(slurm_env, tmp_path, "dp2", "--logs")
    assert job["JobState"] == "COMPLETED", (job, logs[-3000:])
    assert job["NumTasks"] == "2" and job["Requeue"] == "1"
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]
    # Rank 0 writes the config of the world it joined: 2 processes (a rank that fell back to a one-process
    # world would write 1), i.e. DP 2; and both ranks' commands ended.
    cfg = load_config(run_dir)
    assert cfg.parallel.world_size == 2 and cfg.parallel.dp == 2 and cfg.checkpoint.auto_resume
    assert logs.count("run directory: ") == 2 and "step    2/2" in logs
    assert (run_dir / "checkpoints" / "step_2").is_dir()
    assert "COMPLETED, exit code 0:0" in _show(slurm_env, tmp_path, "dp2", "--status")
    assert job_id not in squeue_ids(slurm_env)


@pytest.fixture(scope="module")
def uninterrupted(slurm_env, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("ref")
    job_id, run_dir = _submit(slurm_env, tmp, "ref", "train.steps=8", "checkpoint.save_every=0")
    job = wait_done(slurm_env, job_id, timeout=900)
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "0", job
    return metrics(run_dir)


def _wait_for_steps(run_dir: Path, n: int, env, job_id: str, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if len(metrics(run_dir)) >= n:
            return
        if scontrol_job(env, job_id).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            raise AssertionError(f"job {job_id} ended before step {n}: {scontrol_job(env, job_id)}")
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {timeout} s")


def _start_requeued_now(env, job_id: str, timeout: float) -> None:
    """Slurm makes a requeued batch job eligible only ~2 min later (BeginTime); waive that wait."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        job = scontrol_job(env, job_id)
        if int(job.get("Restarts", "0")) >= 1 and job.get("JobState") == "PENDING":
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env, check=True)
            return
        if job.get("JobState") not in ("RUNNING", "COMPLETING", "PENDING", "REQUEUED", "CONFIGURING"):
            raise AssertionError(f"job {job_id} was not requeued: {job}")
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not requeued within {timeout} s: {scontrol_job(env, job_id)}")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["scontrol-requeue", "usr1"])
def test_preempted_job_requeues_and_matches_an_uninterrupted_run(how, slurm_env, tmp_path, uninterrupted):
    """Preemption (``scontrol requeue``: SIGTERM, then back to the queue) or the time-limit warning
    (``--signal=USR1@N``, here sent at once with ``scancel --signal``): the trainer checkpoints and
    stops, the job runs again, auto-resumes without --resume, and its per-step metrics equal the
    uninterrupted run's."""
    job_id, run_dir = _submit(slurm_env, tmp_path, "pre", "train.steps=8", "checkpoint.save_every=0")
    _wait_for_steps(run_dir, 2, slurm_env, job_id, timeout=600)
    cmd = ["scontrol", "requeue", job_id] if how == "scontrol-requeue" else \
        ["scancel", "--signal=USR1", job_id]
    subprocess.run(cmd, env=slurm_env, check=True)
    _start_requeued_now(slurm_env, job_id, timeout=600)
    job = wait_done(slurm_env, job_id, timeout=900)
    logs = _show(slurm_env, tmp_path, "pre", "--logs")
    assert job["JobState"] == "COMPLETED" and int(job["Restarts"]) >= 1, (job, logs[-3000:])
    assert "checkpoint.auto_resume: resuming" in logs and "stopped by signal" in logs
    got = metrics(run_dir)
    assert [m["step"] for m in got] == list(range(1, 9)), [m["step"] for m in got]
    assert [m["reward/mean"] for m in got] == [m["reward/mean"] for m in uninterrupted]
    assert [comparable(m) for m in got] == [comparable(m) for m in uninterrupted]
    assert job_id not in squeue_ids(slurm_env)


@pytest.mark.slow
def test_failed_task_fails_the_job_with_its_traceback(slurm_env, tmp_path):
    """Rank 1 raises at step 2: the job is FAILED, its log holds the traceback, no allocation remains."""
    job_id, _ = _submit(slurm_env, tmp_path, "bad", "train.steps=3",
                        extra_env={"MASPO_FAULT": "rank=1,step=2,kind=raise"})
    job = wait_done(slurm_env, job_id, timeout=600)
    assert job["JobState"] == "FAILED" and job["Restarts"] == "0", job
    status = _show(slurm_env, tmp_path, "bad", "--status")
    assert "FAILED" in status
    logs = _show(slurm_env, tmp_path, "bad", "--logs")
    assert "Traceback" in logs and "InjectedFault" in logs
    assert job_id not in squeue_ids(slurm_env)

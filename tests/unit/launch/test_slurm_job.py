"""Slurm launch pieces without a cluster: rank environment, job records, auto-resume gating, sbatch text.

The real submissions (a job on a local Slurm cluster, preemption, failure) are in tests/slurm.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_maspo.config import MaspoConfig, load_config, save_config
from megatron_maspo.errors import ConfigError
from megatron_maspo.launch.job import LaunchOptions
from megatron_maspo.launch.requeue import (
    REQUEUE_ENV,
    auto_resume,
    latest_step,
    requeue_if_unfinished,
)
from megatron_maspo.launch.slurm_job import JobRecord, parse_scontrol, read_record, write_record
from megatron_maspo.train.preflight import check_run_dir
from megatron_maspo.train.process.distributed import rank_env_from_slurm

REPO = Path(__file__).resolve().parents[3]
SRUN = {"MASPO_RANKS_FROM_SLURM": "1", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_rank_env_from_slurm_only_when_asked_and_not_under_torchrun():
    assert rank_env_from_slurm(SRUN) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert rank_env_from_slurm({**SRUN, "MASPO_RANKS_FROM_SLURM": "0"}) == {}  # e.g. an salloc shell
    assert rank_env_from_slurm({**SRUN, "WORLD_SIZE": "8"}) == {}  # torchrun already set the world
    broken = {k: v for k, v in SRUN.items() if k not in ("MASTER_ADDR", "SLURM_LOCALID")}
    with pytest.raises(ValueError, match="SLURM_LOCALID, MASTER_ADDR unset"):
        rank_env_from_slurm(broken)


def test_parse_scontrol_line():
    line = ("JobId=7 JobName=maspo-x UserId=root(0) JobState=COMPLETED Reason=None Dependency=(null) "
            "Requeue=1 Restarts=2 BatchFlag=1 ExitCode=0:0 NumTasks=2")
    st = parse_scontrol(line)
    assert (st.state, st.exit_code, st.restarts) == ("COMPLETED", "0:0", 2)
    assert st.describe() == "COMPLETED, exit code 0:0, requeued 2x"
    assert parse_scontrol("JobState=PENDING Reason=BeginTime ExitCode=0:0").describe() == "PENDING (BeginTime)"


def test_job_record_logs_in_attempt_order(tmp_path):
    rec = JobRecord(job_id="12", log_dir=str(tmp_path), run_dir="/r")
    for name, text in [("log-maspo-a_12_10.out", "tenth\n"), ("log-maspo-a_12_2.out", "second\n"),
                       ("sbatch_maspo-a_12.out", "batch\n"), ("log-maspo-a_13_0.out", "other job\n")]:
        (tmp_path / name).write_text(text)
    assert [p.name for p in rec.log_files()] == ["sbatch_maspo-a_12.out", "log-maspo-a_12_2.out",
                                                 "log-maspo-a_12_10.out"]
    out = rec.read_log()
    assert out.index("batch") < out.index("second") < out.index("tenth") and "other job" not in out
    write_record(tmp_path, rec)
    assert read_record(tmp_path) == rec
    with pytest.raises(FileNotFoundError, match="no Slurm job was submitted"):
        read_record(tmp_path / "nowhere")


def _cfg(tmp_path: Path, *, auto: bool, steps: int = 4) -> MaspoConfig:
    cfg = MaspoConfig()
    ckpt = dataclasses.replace(cfg.checkpoint, run_dir=str(tmp_path / "run"), auto_resume=auto)
    return dataclasses.replace(cfg, checkpoint=ckpt, train=dataclasses.replace(cfg.train, steps=steps))


def test_auto_resume_is_explicit_and_the_fresh_run_refusal_stays(tmp_path):
    off, on = _cfg(tmp_path, auto=False), _cfg(tmp_path, auto=True)
    assert MaspoConfig().checkpoint.auto_resume is False  # `maspo train` default
    assert not auto_resume(on)  # nothing to resume yet: a fresh run
    for step in (2, 10):
        (tmp_path / "run" / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_12.tmp").mkdir()  # incomplete: ignored
    assert latest_step(on.checkpoint.run_dir) == 10
    assert auto_resume(on) and not auto_resume(off)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        check_run_dir(off.checkpoint.run_dir, resume=auto_resume(off))
    assert check_run_dir(on.checkpoint.run_dir, resume=auto_resume(on))[-1].name == "step_10"


def test_requeue_only_for_rank0_of_an_unfinished_requeueable_slurm_job(tmp_path):
    cfg = _cfg(tmp_path, auto=True, steps=4)
    (tmp_path / "run" / "checkpoints" / "step_4").mkdir(parents=True)
    env = {"SLURM_JOB_ID": "5", REQUEUE_ENV: "1", "RANK": "0"}
    assert not requeue_if_unfinished(cfg, env)  # finished: step 4 of 4
    unfinished = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=8))
    for gated in ({**env, "RANK": "1"}, {REQUEUE_ENV: "1"}, {**env, REQUEUE_ENV: "0"}):
        assert not requeue_if_unfinished(unfinished, gated)
    off = dataclasses.replace(unfinished, checkpoint=dataclasses.replace(cfg.checkpoint, auto_resume=False))
    assert not requeue_if_unfinished(off, env)


def test_slurm_only_options_are_refused_where_they_cannot_work():
    with pytest.raises(ValueError, match="/nemo_run"):
        LaunchOptions(executor="slurm", account="a", job_dir="/lustre/me/nemo_run/jobs")
    with pytest.raises(ValueError, match="needs --executor slurm"):
        LaunchOptions(executor="local", launcher="srun")
    with pytest.raises(ValueError, match="launcher='mpirun'"):
        LaunchOptions(executor="slurm", account="a", launcher="mpirun")


def _dry_run(tmp_path: Path, *extra: str) -> tuple[str, MaspoConfig]:
    base = tmp_path / "base.yaml"
    save_config(MaspoConfig(), base)
    env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", "launch", "--config", str(base),
                        "--executor", "slurm", "--account", "acc", "--gpus-per-node", "2", "--cpu",
                        "--job-dir", str(tmp_path / "jobs"), "--name", "cpu", "--dry-run", *extra],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, load_config(tmp_path / "jobs" / "cpu" / "config.yaml")


@pytest.mark.launch
def test_slurm_dry_run_of_a_cpu_srun_job_without_container(tmp_path):
    out, cfg = _dry_run(tmp_path, "--launcher", "srun", "--signal-lead", "60")
    root = tmp_path / "jobs" / "cpu"
    assert cfg.checkpoint.auto_resume and cfg.parallel.world_size == 2
    for needle in ("#SBATCH --requeue", "#SBATCH --signal=USR1@60", "#SBATCH --ntasks-per-node=2",
                   "export MASTER_ADDR=$head_node_ip MASTER_PORT=29500 MASPO_RANKS_FROM_SLURM=1",
                   "export MASPO_SLURM_REQUEUE=1", f"export PYTHONPATH={REPO}",
                   f"export PATH={Path(sys.executable).parent}", f"--chdir={root}",
                   f"{root}/nemorun/experiments/cpu/"):
        assert needle in out, needle
    for absent in ("--gpus-per-node", "--container", "CUDA_DEVICE_MAX_CONNECTIONS", "torchrun"):
        assert absent not in out, absent
    out, _ = _dry_run(tmp_path, "--signal-lead", "0")
    assert "#SBATCH --signal" not in out and "#SBATCH --requeue" in out

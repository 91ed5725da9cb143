"""A one-node Slurm cluster on 127.0.0.1 for the ``slurm``-marked tests (scripts/slurm_local.sh).

The session fixture reuses a cluster that already answers at ``$SLURM_CONF`` (e.g. CI started one), else
brings one up in a temporary folder and tears it down at the end. Without the Debian packages or root it
skips with the reason. Helpers here submit through ``maspo launch`` (a subprocess, as a user would).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_maspo.train.observe.timing_keys import is_timing

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm_local.sh"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
# A smaller-than-tiny run (as tests/e2e): one layer, 4 prompts x 4 responses, 6 new tokens.
MICRO = ["model.tiny_num_layers=1", "model.tiny_hidden_size=32", "train.prompts_per_step=4",
         "rollout.group_size=4", "rollout.max_new_tokens=6", "train.sft_steps=2", "data.num_examples=32",
         "logging.tensorboard=false", "logging.plots=false", "reward.num_workers=1",
         "train.max_tokens_per_micro_batch=256"]


def _answers(env: dict[str, str]) -> bool:
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, check=False)
    return r.returncode == 0 and any(s in r.stdout for s in ("idle", "alloc", "mix"))


def _free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (slurmctld, slurmd)."""
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair for slurmctld/slurmd")


@pytest.fixture(scope="session")
def slurm_env(tmp_path_factory) -> dict[str, str]:
    """Environment (``SLURM_CONF``) of a running one-node cluster."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm not installed ({', '.join(missing)} missing): "
                    "apt-get install slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster runs as root (SlurmUser=root)")
    env = dict(os.environ)
    if env.get("SLURM_CONF") and _answers(env):
        yield env
        return
    state = tmp_path_factory.mktemp("slurm")
    # Own ports too: another local cluster (scripts/slurm_local.sh's defaults) may be running.
    env.update(SLURM_LOCAL_DIR=str(state), SLURM_CONF=str(state / "slurm.conf"),
               SLURM_LOCAL_PORT=str(_free_port_pair()))
    up = subprocess.run(["bash", str(SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=120)
    if up.returncode != 0:
        pytest.fail(f"scripts/slurm_local.sh up failed:\n{up.stdout}\n{up.stderr}")
    try:
        yield env
    finally:
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)


def launch(env: dict[str, str], tmp: Path, name: str, *sets: str, extra_env: dict[str, str] | None = None,
           args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``maspo launch tiny --executor slurm`` (1 node x 2 srun tasks, CPU) with MICRO settings + ``sets``."""
    cmd = [sys.executable, "-m", "megatron_maspo.cli.main", "launch", "tiny", "--executor", "slurm",
           "--account", "local", "--partition", "local", "--gpus-per-node", "2", "--cpu",
           "--launcher", "srun", "--job-dir", str(tmp / "jobs"), "--name", name, "--time", "00:30:00",
           "--env", "OMP_NUM_THREADS=1", *args]
    for s in [*MICRO, *sets]:
        cmd += ["--set", s]
    for k, v in (extra_env or {}).items():
        cmd += ["--env", f"{k}={v}"]
    full_env = {**env, "NEMORUN_HOME": str(tmp / "nemorun-home"), "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)


def record(tmp: Path, name: str) -> dict:
    return json.loads((tmp / "jobs" / name / "slurm_job.json").read_text())


def scontrol_job(env: dict[str, str], job_id: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict ({} once slurmctld has forgotten the job)."""
    import re

    r = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True,
                       check=False)
    return dict(re.findall(r"(\w+)=(\S*)", r.stdout)) if r.returncode == 0 else {}


# Pending reasons that no amount of waiting resolves (the request does not fit the cluster).
NEVER = {"PartitionConfig", "PartitionNodeLimit", "BadConstraints", "PartitionTimeLimit"}


def wait_done(env: dict[str, str], job_id: str, timeout: float) -> dict[str, str]:
    """Poll until the job is in a final state; cancels it and fails the test on timeout."""
    final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
    t0 = time.time()
    while time.time() - t0 < timeout:
        job = scontrol_job(env, job_id)
        if job.get("JobState") in final:
            return job
        if job.get("JobState") == "PENDING" and job.get("Reason") in NEVER:
            break
        time.sleep(2)
    subprocess.run(["scancel", job_id], env=env, check=False)
    raise AssertionError(f"job {job_id} not done (waited up to {timeout} s): {scontrol_job(env, job_id)}")


def squeue_ids(env: dict[str, str]) -> list[str]:
    r = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, check=True)
    return r.stdout.split()


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.is_file() else []


def comparable(rec: dict) -> dict:
    # Wall-clock timings and rates, memory figures and lifetime counters of the grader differ between processes.
    return {k: v for k, v in rec.items() if not is_timing(k) and not k.endswith("_total")}

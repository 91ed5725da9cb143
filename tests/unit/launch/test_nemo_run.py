"""NeMo-Run integration: the Slurm dry run of a 4-node recipe, and a real local 2-process launch on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_maspo.config import MaspoConfig, load_config, save_config

pytestmark = pytest.mark.launch
REPO = Path(__file__).resolve().parents[3]


def _launch(argv: list[str], home: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "NEMORUN_HOME": str(home), "OMP_NUM_THREADS": "1"}
    # A subprocess: its own NEMORUN_HOME, and a real stdin (nemo-run's local tunnel reads it via invoke).
    return subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", "launch", *argv], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_slurm_dry_run_of_a_four_node_recipe(tmp_path):
    job_dir = tmp_path / "jobs"
    r = _launch(["r1_distill_qwen_7b_maspo", "--executor", "slurm", "--nodes", "4",
                "--account", "rl-acct", "--partition", "batch", "--time", "12:00:00",
                "--container-image", "nvcr.io/nvidia/pytorch:25.04-py3",
                "--mount", "/lustre/models:/models", "--mount", "/lustre/data:/data",
                "--job-dir", str(job_dir), "--env", "NCCL_IB_HCA=mlx5_0,mlx5_3", "--dry-run"], tmp_path / "home")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    config_path = job_dir / "r1-distill-qwen-7b-maspo" / "config.yaml"
    cfg = load_config(config_path)
    assert cfg.parallel.world_size == 32 and cfg.parallel.dp == 16 and cfg.parallel.tp == 2
    assert cfg.checkpoint.run_dir.startswith(str(job_dir))  # lands on the shared filesystem
    assert "world_size: 32" in out  # the resolved config is printed
    for needle in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1",
                   "#SBATCH --account=rl-acct", "#SBATCH --partition=batch", "#SBATCH --time=12:00:00",
                   "--container-image nvcr.io/nvidia/pytorch:25.04-py3",
                   "/lustre/models:/models", "/lustre/data:/data",
                   f"{config_path.parent}:{config_path.parent}",
                   "export NCCL_IB_HCA=mlx5_0,mlx5_3", "export NCCL_SOCKET_IFNAME=^lo,docker0",
                   "export NCCL_IB_GID_INDEX=3", "export NCCL_NET_GDR_LEVEL=PHB",
                   "export CUDA_DEVICE_MAX_CONNECTIONS=1", "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                   "--rdzv-endpoint $head_node_ip:29500", "--nnodes 4", "--nproc-per-node 8",
                   f"-m megatron_maspo.cli.main train --config {config_path}"):
        assert needle in out, needle
    assert not list((tmp_path / "home").glob("experiments/*/*"))  # the dry-run experiment was removed


def test_local_launch_of_two_gloo_ranks(tmp_path):
    """NeMo-Run's LocalExecutor + torchrun start 2 ranks that find the resolved config and each other."""
    r = _launch(["--config", str(_base_config(tmp_path)), "--executor", "local", "--gpus-per-node", "2",
                 "--job-dir", str(tmp_path / "jobs"), "--name", "ar", "--env", "OMP_NUM_THREADS=1",
                 "--module", "tests.unit.launch._allreduce_task"], tmp_path / "home")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "jobs" / "ar" / "allreduce_result.json").read_text())
    assert out == {"world": 2, "sum": 3.0, "world_size_in_config": 2, "omp": "1", "local_world": 2}


@pytest.mark.slow
def test_failed_local_task_fails_the_command(tmp_path):
    r = _launch(["--config", str(_base_config(tmp_path)), "--executor", "local", "--gpus-per-node", "1",
                 "--job-dir", str(tmp_path / "jobs"), "--name", "bad",
                 "--module", "tests.unit.launch._no_such_module"], tmp_path / "home")
    assert r.returncode == 1 and "ended in state FAILED" in r.stderr


def _base_config(tmp_path: Path) -> Path:
    path = tmp_path / "base.yaml"
    save_config(MaspoConfig(), path)
    return path


@pytest.mark.slow
def test_local_launch_of_a_tp2_megatron_step_on_cpu(tmp_path):
    """Two torchrun ranks (gloo) started by NeMo-Run's LocalExecutor run a TP=2 forward/backward."""
    r = _launch(["--config", str(_base_config(tmp_path)), "--set", "parallel.tp=2", "--executor", "local", "--gpus-per-node", "2",
                 "--job-dir", str(tmp_path / "jobs"), "--name", "tp2", "--env", "OMP_NUM_THREADS=1",
                 "--module", "tests.unit.launch._tp2_task"], tmp_path / "home")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "jobs" / "tp2" / "tp2_result.json").read_text())
    assert out["world"] == 2 and out["tp"] == 2 and out["world_size_in_config"] == 2
    assert out["omp"] == "1" and 0 < out["loss"] < 20 and out["local_grad_norm_sq"] > 0


@pytest.mark.slow
def test_local_launch_of_the_tiny_recipe(tmp_path):
    run_dir = tmp_path / "run"
    r = _launch(["tiny", "--executor", "local", "--gpus-per-node", "2", "--job-dir", str(tmp_path / "jobs"),
                 "--name", "tiny", "--set", "train.steps=1", "--set", f"checkpoint.run_dir={run_dir}",
                 "--env", "OMP_NUM_THREADS=1"], tmp_path / "home", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert load_config(run_dir).parallel.world_size == 2

"""Process-group set-up for ``maspo train``: torchrun env, or a one-process world."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_maspo.parallel import comm
from megatron_maspo.parallel.device import on_cuda
from megatron_maspo.parallel.launch import free_port

# Set by the srun-native Slurm launch (``launch/nemo_run.py``): each task derives RANK / WORLD_SIZE /
# LOCAL_RANK from Slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (see rank_env_from_slurm); the
# batch script exports MASTER_ADDR (the first node's IP) and MASTER_PORT.
SRUN_RANKS_ENV = "MASPO_RANKS_FROM_SLURM"


def setup_distributed(timeout_s: float = 1800.0) -> tuple[int, int]:
    """Bind GPU ``LOCAL_RANK``, join the default process group (NCCL on GPU, gloo on CPU); returns
    (rank, world_size).

    Under torchrun the environment names the world; otherwise a one-process world on a free loopback port.
    See :mod:`megatron_maspo.parallel.comm` for why the default group is NCCL-only on GPU.
    """
    if not on_cuda():
        # Tiny CPU ops gain nothing from intra-op threads, and spin-waiting OpenMP threads made every op
        # ~30x slower when other processes (grader workers, other ranks) share the cores. One thread per
        # rank unless OMP_NUM_THREADS says otherwise.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    os.environ.update(rank_env_from_slurm(dict(os.environ)))  # srun-native Slurm launch: ranks from Slurm
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
    comm.bind_local_device()
    return comm.init_default_group(timeout_s)


def rank_env_from_slurm(env: dict[str, str]) -> dict[str, str]:
    """torch.distributed's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` from an srun task's environment.

    Empty unless the launcher asked for it (``MASPO_RANKS_FROM_SLURM=1``) and torchrun did not already
    set ``WORLD_SIZE``: an interactive ``salloc`` shell also carries SLURM_* variables and must stay a
    one-process run. ``MASTER_ADDR`` / ``MASTER_PORT`` come from the batch script.

    Raises:
        ValueError: asked for, but a SLURM_* or MASTER_* variable is missing.
    """
    if env.get(SRUN_RANKS_ENV) != "1" or "WORLD_SIZE" in env:
        return {}
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT")
               if k not in env]
    if missing:
        raise ValueError(f"{SRUN_RANKS_ENV}=1 but {', '.join(missing)} unset: start the task with srun "
                         "inside an allocation whose batch script exports MASTER_ADDR and MASTER_PORT")
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env["SLURM_LOCALID"]}

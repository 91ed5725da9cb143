"""Process-group set-up for ``maspo train``: torchrun env, or a one-process world."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_maspo.parallel import comm
from megatron_maspo.parallel.launch import free_port


def setup_distributed(timeout_s: float = 1800.0) -> tuple[int, int]:
    """Bind GPU ``LOCAL_RANK``, join the default process group (NCCL on GPU, gloo on CPU); returns
    (rank, world_size).

    Under torchrun the environment names the world; otherwise a one-process world on a free loopback port.
    See :mod:`megatron_maspo.parallel.comm` for why the default group is NCCL-only on GPU.
    """
    if not torch.cuda.is_available():
        # Tiny CPU ops gain nothing from intra-op threads, and spin-waiting OpenMP threads made every op
        # ~30x slower when other processes (grader workers, other ranks) share the cores. One thread per
        # rank unless OMP_NUM_THREADS says otherwise.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    from megatron_maspo.launch.job import rank_env_from_slurm

    os.environ.update(rank_env_from_slurm(dict(os.environ)))  # srun-native Slurm launch: ranks from Slurm
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
    comm.bind_local_device()
    return comm.init_default_group(timeout_s)

"""Process-group set-up for ``maspo train``: torchrun env, or a one-process world."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_maspo.parallel import comm
from megatron_maspo.parallel.device import on_cuda
from megatron_maspo.parallel.launch import free_port
from megatron_maspo.parallel.slurm_ranks import SRUN_RANKS_ENV as SRUN_RANKS_ENV
from megatron_maspo.parallel.slurm_ranks import rank_env_from_slurm as rank_env_from_slurm
from megatron_maspo.rollout.pools import ROLLOUT, PoolLayout


def setup_distributed(timeout_s: float = 1800.0) -> tuple[int, int]:
    """Bind GPU ``LOCAL_RANK``, join the default process group (NCCL on GPU, gloo on CPU); returns
    (rank, world_size).

    Under torchrun the environment names the world; otherwise a one-process world on a free loopback port.
    See :mod:`megatron_maspo.parallel.comm` for why the default group is NCCL-only on GPU.
    """
    _cpu_threads()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    job_rank_env()
    comm.bind_local_device()
    return comm.init_default_group(timeout_s)


def _cpu_threads() -> None:
    if not on_cuda():
        # Tiny CPU ops gain nothing from intra-op threads, and spin-waiting OpenMP threads made every op
        # ~30x slower when other processes (grader workers, other ranks) share the cores. One thread per
        # rank unless OMP_NUM_THREADS says otherwise.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def job_rank_env() -> tuple[int, int]:
    """This process's global (rank, world size), with RANK / WORLD_SIZE / LOCAL_RANK set in the
    environment: from torchrun, from Slurm (srun-native launch), or a one-process world."""
    os.environ.update(rank_env_from_slurm(dict(os.environ)))  # srun-native Slurm launch: ranks from Slurm
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.update(comm.emulated_node_env())  # MASPO_EMULATE_GPUS_PER_NODE: nodes on one host
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


@dataclass
class JobPools:
    """This process's place in a disaggregated job: the layout, its global rank and the job store the
    bridges between the pools are built on."""

    layout: PoolLayout
    rank: int
    store: Any

    @property
    def role(self) -> str:
        return self.layout.role(self.rank)

    @property
    def is_rollout(self) -> bool:
        return self.role == ROLLOUT


def setup_pools(make_layout, timeout_s: float = 1800.0) -> JobPools:
    """Split the job into its training and rollout pools: each pool's ranks become the default group
    (so Megatron sees only the trainers), and the job store is kept for the bridges between them.

    Args:
        make_layout: ``world -> PoolLayout`` (``rollout.pools.build_pools`` of the run's sections).
        timeout_s: how long a store wait may last: ``rollout.pool_timeout_s`` (hours), since the bridges
            between the pools are set up through the store while the trainer may still be loading a
            checkpoint or warming up (the rollout pool is ready long before).
    """
    _cpu_threads()
    if dist.is_initialized():
        raise RuntimeError("setup_pools: a default process group exists already (one placement per process)")
    rank, world = job_rank_env()
    layout = make_layout(world)
    if layout.role(rank) == ROLLOUT:
        # Megatron wants one hardware queue (TP comm kernels in issue order); an engine does not: its weight
        # receiver's NCCL kernel on a side stream would then stall the decode kernels queued behind it.
        # Read when the CUDA context is created, i.e. below.
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    store = comm.job_store(timeout_s)
    comm.bind_local_device()
    size = layout.trainer_world if layout.role(rank) != ROLLOUT else layout.engine_ranks
    comm.init_pool_group(store, layout.role(rank), layout.pool_rank(rank), size, timeout_s)
    return JobPools(layout, rank, store)

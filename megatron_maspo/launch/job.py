"""What a launch needs, without NeMo-Run: options, the environment of the job, the resolved config file.

``maspo launch`` resolves a recipe (+ ``--set``) into a :class:`MaspoConfig`, fixes its world size to the
cluster it will run on, writes it to ``<job_dir>/<name>/config.yaml`` and asks
:mod:`megatron_maspo.launch.nemo_run` to run ``python -m megatron_maspo.cli.main train --config <file>``
under torchrun. Only that leaf module imports ``nemo_run``; everything here is plain data so it can be
tested and reused without the ``launch`` extra.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_maspo.config import MaspoConfig

logger = logging.getLogger(__name__)

EXECUTORS = ("local", "slurm")
LAUNCHERS = ("torchrun", "srun")
TRAIN_MODULE = "megatron_maspo.cli.main"

# Environment every GPU job gets. CUDA_DEVICE_MAX_CONNECTIONS=1 keeps Megatron's TP communication kernels
# ordered before the compute that depends on them; async NCCL error handling turns a hung collective
# into a crash the scheduler sees.
GPU_ENV: dict[str, str] = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NCCL_DEBUG": "WARN",
    "TOKENIZERS_PARALLELISM": "false",
}
# Multi-node InfiniBand / RoCE defaults; every value is overridable with --env KEY=VALUE.
MULTINODE_ENV: dict[str, str] = {
    "NCCL_IB_HCA": "mlx5",             # prefix: every mlx5 HCA; pin ports with e.g. "=mlx5_0:1,mlx5_1:1"
    "NCCL_SOCKET_IFNAME": "^lo,docker0",  # bootstrap/out-of-band interface: anything but loopback/docker
    "NCCL_IB_GID_INDEX": "3",          # RoCE v2 GID; native InfiniBand ignores it (set 0 if required)
    "NCCL_NET_GDR_LEVEL": "PHB",       # GPUDirect RDMA when GPU and NIC share a PCIe host bridge
    "NCCL_IB_TIMEOUT": "22",           # longer IB retransmit timeout: large clusters, congested fabrics
    "NCCL_IB_QPS_PER_CONNECTION": "2",
}
# The master address is not an env default: the generated sbatch script resolves the first node's IP and
# torchrun's c10d rendezvous runs there on LaunchOptions.master_port; torchrun then sets MASTER_ADDR /
# MASTER_PORT for the workers itself.


@dataclass(kw_only=True)
class LaunchOptions:
    """Where and how to run a training job (the ``maspo launch`` flags)."""

    executor: str = "local"
    """``"local"`` (this machine, torchrun) or ``"slurm"`` (sbatch + srun + torchrun, pyxis container)."""
    name: str = "maspo"
    """Experiment / job name."""
    nodes: int = 1
    """Nodes (local: must be 1)."""
    gpus_per_node: int = 8
    """Processes per node: GPUs on a GPU node (local CPU runs: ranks)."""
    job_dir: str = "runs/launch"
    """Directory for the resolved config and NeMo-Run's job files; on Slurm a shared filesystem path that
    the nodes see at the same path (it is mounted into the container)."""
    account: str | None = None
    """Slurm account (required for Slurm)."""
    partition: str | None = None
    """Slurm partition."""
    time: str = "04:00:00"
    """Slurm wall-clock limit, HH:MM:SS."""
    container_image: str | None = None
    """Container image (enroot/pyxis), e.g. ``nvcr.io/nvidia/pytorch:25.04-py3`` with this package inside."""
    container_mounts: list[str] = field(default_factory=list)
    """``src:dst`` mounts, e.g. ``/lustre/models:/models``."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra / overriding environment variables."""
    master_port: int = 29500
    """torchrun c10d rendezvous port on the first node (the master address is that node's IP)."""
    launcher: str = "torchrun"
    """``"torchrun"``: one Slurm task per node spawning ``gpus_per_node`` workers; ``"srun"``: one Slurm
    task per rank, ranks from Slurm's environment. With ``srun`` every rank receives Slurm's signals
    itself; torchrun forwards them but kills workers that take longer than 30 s to stop."""
    cpu: bool = False
    """CPU-only nodes: no GPU request, no CUDA environment (the processes use gloo)."""
    signal_lead_s: int = 300
    """Slurm: send SIGUSR1 to every task this many seconds before the time limit (0: none). The
    trainer checkpoints, stops, and requeues the job if its steps are not done."""
    python: str | None = None
    """Interpreter of the tasks without a container (default: the launcher's own, ``sys.executable``;
    the nodes must see it at the same path)."""

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor={self.executor!r}; accepted: {list(EXECUTORS)}")
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"nodes and gpus_per_node must be >= 1, got {self.nodes}, {self.gpus_per_node}")
        if self.executor == "local" and self.nodes != 1:
            raise ValueError(f"the local executor runs on one node; got nodes={self.nodes}")
        if self.executor == "slurm" and not self.account:
            raise ValueError("the slurm executor needs --account")
        if not re.fullmatch(r"\d+(-\d+)?:\d\d:\d\d|\d+-\d+", self.time):
            raise ValueError(f"time={self.time!r}; accepted: HH:MM:SS or D-HH:MM:SS")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ValueError(f"name={self.name!r}; accepted: letters, digits, '_', '.', '-'")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r}; accepted: {list(LAUNCHERS)}")
        if self.executor == "local" and self.launcher != "torchrun":
            raise ValueError("the local executor runs torchrun; --launcher srun needs --executor slurm")
        if self.signal_lead_s < 0:
            raise ValueError(f"signal_lead_s={self.signal_lead_s}; accepted: >= 0")
        if not 1024 <= self.master_port <= 65535:
            raise ValueError(f"master_port={self.master_port}; accepted: 1024..65535")
        if self.executor == "slurm" and "/nemo_run" in str(Path(self.job_dir).resolve()):
            # nemo-run 0.11.1 rewrites "/nemo_run" in its job paths (its in-container run dir name).
            raise ValueError(f"job_dir={self.job_dir!r}: a path containing '/nemo_run' is garbled by "
                             "NeMo-Run; choose another")
        for m in self.container_mounts:
            if ":" not in m:
                raise ValueError(f"container mount {m!r} must be src:dst[:flags]")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def job_env(opts: LaunchOptions, *, cuda: bool = True) -> dict[str, str]:
    """Environment of the task processes: GPU defaults, multi-node NCCL/IB defaults, then ``opts.env``."""
    env: dict[str, str] = {}
    if cuda:
        env.update(GPU_ENV)
    if opts.nodes > 1:
        env.update(MULTINODE_ENV)
    env.update(opts.env)
    if opts.nodes > 1 and "GLOO_SOCKET_IFNAME" not in env:
        # gloo takes exact interface names (no "^lo" exclusions as NCCL_SOCKET_IFNAME does), so no default
        logger.warning("multi-node job without GLOO_SOCKET_IFNAME: the distributed optimizer's gloo groups "
                       "(checkpoint saves) bind the interface the hostname resolves to; pass --env "
                       "GLOO_SOCKET_IFNAME=<the nodes' routable interface, e.g. ib0 or eth0>")
    return env


def parse_env(pairs: list[str]) -> dict[str, str]:
    """``["K=V", ...]`` -> dict; raises ValueError naming a malformed pair."""
    out = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"--env {p!r}: expected KEY=VALUE with a shell-safe KEY")
        out[key] = value
    return out


def job_root(opts: LaunchOptions) -> Path:
    """Absolute ``<job_dir>/<name>``: the resolved config, and on Slurm the run directory, live here."""
    return (Path(opts.job_dir) / opts.name).resolve()


def nemo_run_dir(opts: LaunchOptions) -> Path:
    """``<job root>/nemorun``: NeMo-Run's experiment folders (sbatch script, logs) of a Slurm launch."""
    return job_root(opts) / "nemorun"


def resolve_for_cluster(cfg: MaspoConfig, opts: LaunchOptions) -> MaspoConfig:
    """``cfg`` with ``parallel.world_size`` set to the job's process count (re-validated).

    On Slurm a relative ``checkpoint.run_dir`` is moved under :func:`job_root` (a shared path mounted at
    the same place in the container), so checkpoints land on the shared filesystem, not in the container.
    Slurm jobs get ``checkpoint.auto_resume``: NeMo-Run submits every job requeueable (``sbatch
    --requeue``), and a requeued job reruns the same command, which must continue, not refuse.
    """
    parallel = dataclasses.replace(cfg.parallel, world_size=opts.world_size)
    ckpt = cfg.checkpoint
    if opts.executor == "slurm" and not Path(ckpt.run_dir).is_absolute():
        ckpt = dataclasses.replace(ckpt, run_dir=str(job_root(opts) / ckpt.run_dir))
    if opts.executor == "slurm":
        ckpt = dataclasses.replace(ckpt, auto_resume=True)
    return dataclasses.replace(cfg, parallel=parallel, checkpoint=ckpt)


def write_config(cfg: MaspoConfig, opts: LaunchOptions) -> Path:
    """Write the resolved config to ``<job_dir>/<name>/config.yaml`` and return its absolute path."""
    from megatron_maspo.config import save_config

    path = job_root(opts) / "config.yaml"
    save_config(cfg, path)
    return path


def train_args(config_path: str | os.PathLike) -> list[str]:
    """Arguments after ``python -m megatron_maspo.cli.main`` for the training task."""
    return ["train", "--config", str(config_path)]

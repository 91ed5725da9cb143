"""Spawn N local ranks and run a function on each (tests, benchmarks, CPU demos, local conversion).

Each worker pins one intra-op thread, binds its GPU when CUDA is present (NCCL when every rank has
a GPU, else gloo), joins the group on a free loopback port with a timeout (a mismatched collective
fails instead of hanging), runs ``fn(rank, world_size, *args)`` and tears the group down. A rank that
raises records its traceback and exits at once without teardown (see
:mod:`megatron_maspo.parallel.failure`); the parent then ends the others and re-raises every
recorded traceback, the first failing rank first. Results travel through files in a temporary
folder (a pipe would block a rank on large results before the parent joins, and tensors in a torch
queue live in the child's shared memory, gone once it exits).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_maspo.parallel import comm
from megatron_maspo.parallel.device import on_cuda


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerError(RuntimeError):
    """A spawned rank raised; the message carries the rank and its traceback."""


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, timeout_s: float,
           out_dir: str, args: tuple, backend: str | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    # one GPU per rank (NCCL); more ranks than GPUs share them round-robin through gloo (tests only)
    backend = backend or ("nccl" if on_cuda() and world_size <= torch.cuda.device_count() else "gloo")
    if on_cuda() and backend != "nccl":
        comm.bind_local_device(rank % torch.cuda.device_count())
    comm.init_default_group(timeout_s, backend=backend)  # binds LOCAL_RANK for NCCL; MASPO_EMULATE_GPU
    path = Path(out_dir) / f"rank{rank}"
    try:
        out = fn(rank, world_size, *args)
        torch.save(("ok", out), path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    except BaseException:
        torch.save(("error", traceback.format_exc()), path)
        if world_size > 1:
            from megatron_maspo.parallel.failure import report_and_exit

            report_and_exit(f"worker rank {rank}")  # no teardown: peers may be mid-collective
        _teardown()
        raise
    _teardown()


def _teardown() -> None:
    if "megatron.core.parallel_state" in sys.modules:  # importing Megatron just to tear down costs seconds
        try:
            from megatron_maspo.parallel.groups import destroy_parallel

            destroy_parallel()
        except Exception:
            pass
    dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any,
                timeout_s: float = 300.0, backend: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks (gloo on CPU; ``backend``
    overrides the default, e.g. ``"nccl"`` for GPU tests with one device per rank).

    ``fn`` must be a module-level function (it is pickled). Returns each rank's return value, in rank
    order (values must be picklable by ``torch.save``).

    Raises:
        WorkerError: a rank raised; the message names every failing rank and its traceback.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="maspo_workers_") as out_dir:
        try:
            ctx = mp.start_processes(_entry, args=(fn, world_size, port, timeout_s, out_dir, args, backend),
                                     nprocs=world_size, join=False, start_method="spawn")
            # After a failure: 5 s for the others to exit on their own (gloo peers see the closed
            # connection), then SIGTERM, 5 s, SIGKILL.
            while not ctx.join(grace_period=5.0):
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            first = e.error_index
            msgs = []
            for r in [first, *[r for r in range(world_size) if r != first]]:
                p = Path(out_dir) / f"rank{r}"
                if p.exists():
                    status, payload = torch.load(p, weights_only=False)
                    if status == "error":
                        msgs.append(f"--- rank {r} ---\n{payload}")
            raise WorkerError("spawned rank(s) failed:\n" + ("\n".join(msgs) or str(e))) from None
        results = []
        for r in range(world_size):
            status, payload = torch.load(Path(out_dir) / f"rank{r}", weights_only=False)
            results.append(payload)
        return results

"""Spawn N local gloo ranks and run a function on each (tests, benchmarks, CPU demos).

Each worker pins one intra-op thread, joins a gloo group on a free loopback port with a timeout (a
mismatched collective fails instead of hanging), runs ``fn(rank, world_size, *args)`` and tears the
group down. A failing rank's traceback is re-raised in the parent, prefixed with its rank. Results
travel through files in a temporary folder (a pipe would block a rank on large results before the
parent joins, and tensors in a torch queue live in the child's shared memory, gone once it exits).
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerError(RuntimeError):
    """A spawned rank raised; the message carries the rank and its traceback."""


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, timeout_s: float,
           out_dir: str, args: tuple, backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if backend == "nccl":  # GPU tests: one device per rank
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    path = Path(out_dir) / f"rank{rank}"
    try:
        out = fn(rank, world_size, *args)
        torch.save(("ok", out), path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    except BaseException:
        torch.save(("error", traceback.format_exc()), path)
        raise
    finally:
        try:
            from megatron_maspo.parallel.groups import destroy_parallel

            destroy_parallel()
        except Exception:
            pass
        dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any,
                timeout_s: float = 300.0, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks
    (``backend="nccl"``: one CUDA device per rank, for GPU tests).

    ``fn`` must be a module-level function (it is pickled). Returns each rank's return value, in rank
    order (values must be picklable by ``torch.save``).

    Raises:
        WorkerError: a rank raised; the message names every failing rank and its traceback.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="maspo_workers_") as out_dir:
        try:
            mp.start_processes(_entry, args=(fn, world_size, port, timeout_s, out_dir, args, backend),
                               nprocs=world_size, join=True, start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            msgs = []
            for r in range(world_size):
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

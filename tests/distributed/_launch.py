"""Test-side spawn helper: :func:`run_workers` with the package's contract (see
megatron_maspo/parallel/launch.py), served by long-lived worker pools.

A fresh spawned world pays for process start-up and the torch, Megatron and transformers imports on
every rank (~10 s per world on 2 idle cores, several times that on a loaded box), and the default
test run starts some forty worlds. A pool keeps one world per world size alive for the session; its
group timeout is ``POOL_TIMEOUT_S``, the largest a default-run test asks for (a hung collective fails
after that long rather than after the call's own ``timeout_s``). Each call sends ``fn`` and its
arguments to every rank, which runs ``fn(rank, world_size, *args)`` on the same gloo default group,
then tears Megatron's parallel state and every other process group down and resets torch's default
RNG to the seed a fresh process starts with, so a call sees what a fresh world would. A pool whose
ranks keep more than ``MAX_IDLE_THREADS`` threads after that is replaced. A rank that raises records
its traceback and exits (as in the package helper); the parent ends the pool's other ranks, raises
:class:`WorkerError` with every recorded traceback (the failing rank first), and the next call
starts a new pool.

``fresh=True`` (or CUDA, an explicit ``backend``, or a ``timeout_s`` above the pool's) uses the
package helper, a new world per call: for tests of the helper's own failure handling, or whose ranks
patch process-wide state.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from megatron_maspo.parallel.launch import WorkerError, free_port
from megatron_maspo.parallel.launch import run_workers as _fresh_run_workers

__all__ = ["WorkerError", "free_port", "run_workers"]

POOL_TIMEOUT_S = 600.0
# Process groups that something still references survive the reset (Megatron's gloo groups for the
# distributed optimizer, objects kept by Megatron's caches): each keeps gloo threads polling, about
# 0.2 % of a core per thread while the pool waits. A rank left with more threads than this after a
# call ends its pool; the next call starts a new one.
MAX_IDLE_THREADS = 48


def _pool_entry(rank: int, world_size: int, port: int, timeout_s: float, tasks) -> None:
    import torch.distributed as dist

    from megatron_maspo.parallel import comm
    from megatron_maspo.parallel.device import import_megatron_core

    import_megatron_core()  # before any task's module imports it: the cheap import on CPU
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    seed0 = torch.initial_seed()  # what a fresh process starts with
    # more ranks than GPUs share them through gloo (a test-bench arrangement, never the product's)
    cuda = torch.cuda.is_available() and world_size <= torch.cuda.device_count()
    comm.init_default_group(timeout_s, backend="nccl" if cuda else "gloo")  # MASPO_EMULATE_GPU applies here
    while True:
        task = tasks.get()
        if task is None:
            break
        task_dir = Path(task)
        path = task_dir / f"rank{rank}"
        torch.manual_seed(seed0)
        try:
            fn, args = torch.load(task_dir / "task", weights_only=False)
            out = fn(rank, world_size, *args)
            torch.save(("ok", out), path.with_suffix(".tmp"))
        except BaseException:
            import traceback

            torch.save(("error", traceback.format_exc()), path)
            from megatron_maspo.parallel.failure import report_and_exit

            report_and_exit(f"worker rank {rank}")  # no teardown: peers may be mid-collective
        _reset_process()
        (task_dir / f"threads{rank}").write_text(str(_num_threads()))
        os.replace(path.with_suffix(".tmp"), path)  # after the teardown: the next task starts clean
    dist.destroy_process_group()


def _num_threads() -> int:
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/task"))
    except OSError:  # not Linux
        return 0


def _reset_process() -> None:
    """What a rank's exit would end: Megatron's parallel state, every process group but the default one
    (each gloo group keeps polling threads alive), and the rank's daemonic children."""
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if "megatron.core.parallel_state" in sys.modules:
        from megatron_maspo.parallel.groups import destroy_parallel

        destroy_parallel()
    for pg in list(c10d._world.pg_map):
        if pg is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(pg)
    for child in mp.active_children():
        if child.daemon:
            child.terminate()
            child.join(5.0)
    gc.collect()


class _Pool:
    def __init__(self, world_size: int, timeout_s: float):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.world_size = world_size
        self.key = world_size
        self.queues = [ctx.Queue() for _ in range(world_size)]
        # Not daemonic: a rank may start processes of its own (grader pools, conversions).
        self.procs = [ctx.Process(target=_pool_entry, args=(r, world_size, port, timeout_s, q))
                      for r, q in enumerate(self.queues)]
        for p in self.procs:
            p.start()
        self.root = tempfile.mkdtemp(prefix="maspo_pool_")
        self.calls = 0

    def run(self, fn: Callable[..., Any], args: tuple) -> list[Any]:
        self.calls += 1
        task_dir = Path(self.root) / f"task{self.calls}"
        task_dir.mkdir()
        try:
            torch.save((fn, args), task_dir / "task")
            for q in self.queues:
                q.put(str(task_dir))
            files = [task_dir / f"rank{r}" for r in range(self.world_size)]
            while not all(f.exists() for f in files):
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    self._fail(task_dir, dead[0])
                time.sleep(0.02)
            out = [torch.load(f, weights_only=False)[1] for f in files]
            threads = max(int((task_dir / f"threads{r}").read_text()) for r in range(self.world_size))
            if threads > MAX_IDLE_THREADS:
                self.close()  # the next call starts a new pool
            return out
        finally:
            shutil.rmtree(task_dir, ignore_errors=True)

    def _fail(self, task_dir: Path, first: int) -> None:
        # As the package helper: 5 s for the others to exit on their own, then SIGTERM, 5 s, SIGKILL.
        self.close(grace_s=5.0)
        msgs = []
        for r in [first, *[r for r in range(self.world_size) if r != first]]:
            p = task_dir / f"rank{r}"
            if p.exists():
                status, payload = torch.load(p, weights_only=False)
                if status == "error":
                    msgs.append(f"--- rank {r} ---\n{payload}")
        codes = [p.exitcode for p in self.procs]
        raise WorkerError("spawned rank(s) failed:\n" + ("\n".join(msgs) or f"exit codes {codes}"))

    def close(self, grace_s: float = 0.0) -> None:
        if _POOLS.get(self.key) is self:
            del _POOLS[self.key]
        if grace_s == 0.0:
            for p, q in zip(self.procs, self.queues):
                if p.is_alive():
                    q.put(None)
            grace_s = 10.0
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for sig_wait in ("terminate", "kill"):
            alive = [p for p in self.procs if p.is_alive()]
            for p in alive:
                getattr(p, sig_wait)()
            for p in alive:
                p.join(5.0)
        shutil.rmtree(self.root, ignore_errors=True)


_POOLS: dict[int, _Pool] = {}


def _close_all() -> None:
    for pool in list(_POOLS.values()):
        pool.close()


atexit.register(_close_all)


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0,
                backend: str | None = None, fresh: bool = False) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks; each rank's return value, in rank order.

    Raises:
        WorkerError: a rank raised; the message names every failing rank and its traceback.
    """
    from megatron_maspo.parallel.device import on_cuda

    if fresh or backend is not None or timeout_s > POOL_TIMEOUT_S or on_cuda():
        return _fresh_run_workers(fn, world_size, *args, timeout_s=timeout_s, backend=backend)
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(grace_s=1.0)
        pool = _POOLS[world_size] = _Pool(world_size, POOL_TIMEOUT_S)
    return pool.run(fn, args)

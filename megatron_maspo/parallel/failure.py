"""An exception on one rank ends every rank promptly, with that rank's traceback.

Without this, a rank that raises unwinds through ``finally`` blocks (which may run a collective the
others never join), then waits in ``destroy_process_group`` or at interpreter exit while its peers sit
in their next collective until the NCCL timeout (30 minutes by default). Instead, in a multi-rank world
:func:`exit_on_error` prints ``[rank r] ... failed`` and the traceback to stderr, flushes, and leaves
with ``os._exit(1)``: no collective, no teardown, no waiting on non-daemon threads. How the peers end:

- gloo (CPU): the dead rank's sockets close; a peer blocked in (or entering) a collective gets a
  connection error at once, which its own :func:`exit_on_error` turns into an exit;
- NCCL under torchrun: torchrun sees a non-zero exit and stops the other local ranks (SIGTERM, then
  SIGKILL after its grace period: a rank blocked inside a CUDA wait does not run Python signal
  handlers); other nodes' agents follow through the rendezvous. Under Slurm without torchrun, use
  ``srun --kill-on-bad-exit=1``;
- ``run_workers`` (spawned local ranks): the parent sees the non-zero exit and terminates the rest.

The failing rank does not abort the NCCL communicator itself: ``os._exit`` releases it with the
process, and ``destroy_process_group`` after an error can block on the very collective that failed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Iterator

logger = logging.getLogger(__name__)


def _group_initialized() -> bool:
    """Whether this process has a default process group. Looked up in ``sys.modules`` instead of
    imported: a process that never imported ``torch.distributed`` has none, and the CLI's one-line
    errors (``maspo train --print-config``, a bad ``--set``) then cost no torch import."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _rank_and_world() -> tuple[int, int]:
    """The job's (rank, world): the launcher's numbering first, since in a disaggregated job each pool's
    default group counts its own ranks from 0 (``rollout/pools.py``)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if _group_initialized():
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def report_and_exit(what: str, code: int = 1) -> None:
    """Print the current exception's traceback prefixed with the rank, flush, ``os._exit(code)``."""
    rank, world = _rank_and_world()
    text = traceback.format_exc()
    sys.stderr.write(f"[rank {rank}/{world}] {what} failed; ending this rank so the others stop too\n"
                     + "".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines()))
    for h in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


@contextlib.contextmanager
def exit_on_error(what: str) -> Iterator[None]:
    """Within the block, an exception in a multi-rank world ends this process (see module docstring).

    Before the process group exists (config errors) or in a one-process world, exceptions propagate
    as usual (one-line errors, the CLI's exit codes): no peer can be waiting on this rank yet.
    ``SystemExit(0)`` passes through.
    """
    try:
        yield
    except BaseException as e:
        if isinstance(e, SystemExit) and not e.code:
            raise
        if not (_group_initialized() and _rank_and_world()[1] > 1):
            raise
        report_and_exit(what)

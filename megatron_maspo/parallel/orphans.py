"""Helper processes end with the trainer, SIGKILL included.

A SIGKILLed trainer runs no ``finally`` and no ``atexit``, so whatever it started must notice on its own.
Linux's parent-death signal does that: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` in the child makes the kernel
kill it when the thread that created it exits. Used for:

* children the trainer forks with ``os.fork`` (Megatron-Core's checkpoint writers fork one process per
  write bucket during every save): an at-fork hook sets the signal in the child, and puts SIGTERM/SIGINT
  back to their defaults (a forked copy of the trainer would otherwise keep the trainer's
  stop-at-the-next-step handler and ignore SIGTERM);
* the ``multiprocessing`` Manager whose queue Megatron's writers report through (a spawned server, alive
  for the whole run): :func:`own_checkpoint_queue` starts it here, with the signal set in its initializer;
* the grading workers (``reward/pool.py`` calls :func:`die_with_parent` first thing).

Elsewhere than Linux these are no-ops. The resource tracker ``multiprocessing`` starts exits by itself
once every process holding its pipe is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Any

_PR_SET_PDEATHSIG = 1
_state: dict[str, Any] = {"hooked": False, "forking_from_main": False, "parent": 0}


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) dies; True when set.

    If the parent is already gone (it died between our fork and this call) the process exits at once.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent == 1 or (_state["parent"] and os.getppid() != _state["parent"]):
        os._exit(1)  # orphaned already: nothing will ever read what this process produces
    return True


def _before_fork() -> None:
    _state["forking_from_main"] = threading.current_thread() is threading.main_thread()
    _state["parent"] = os.getpid()


def _after_fork_in_child() -> None:
    # The signal fires when the forking *thread* exits: only tie children forked from the main thread,
    # so a helper thread that forks and ends cannot take its child with it.
    if _state["forking_from_main"]:
        die_with_parent()
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_DFL)
    _state["parent"] = 0


def install_fork_hook() -> None:
    """Every ``os.fork`` child of this process (from its main thread) dies with it. Idempotent."""
    if _state["hooked"] or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _state["hooked"] = True


def _manager_init() -> None:
    die_with_parent()


def own_checkpoint_queue() -> None:
    """Give Megatron's async checkpoint writer a results queue whose Manager dies with this process.

    Megatron creates it lazily (``filesystem_async._get_write_results_queue``: a spawned Manager that
    outlived a SIGKILLed trainer for minutes). Creating it first, the same way plus the death signal,
    leaves Megatron's code path unchanged. Idempotent; a Megatron without that global is left alone.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
    except ImportError:
        return
    if getattr(fsa, "_results_queue", "missing") is not None:
        return  # already created (by us or by Megatron), or a version without the global
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=_manager_init)
    fsa._results_queue = manager.Queue()
    _state["manager"] = manager  # kept referenced: the proxy needs its server for the whole run


def prepare_child_processes() -> None:
    """Both of the above: call before the first checkpoint save (cheap after the first call)."""
    install_fork_hook()
    own_checkpoint_queue()

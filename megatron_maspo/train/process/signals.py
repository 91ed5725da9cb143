"""SIGTERM / SIGINT / SIGUSR1: finish the current step, checkpoint, exit cleanly.

SIGUSR1 is what ``maspo launch --executor slurm`` asks Slurm to send ahead of the time limit
(``--signal=USR1@N``); SIGTERM is what preemption and ``scontrol requeue`` send.

The handler only sets a flag; the loop checks it at step boundaries (a checkpoint written from inside a
signal handler, in the middle of a collective, would corrupt state or hang the other ranks). Ranks agree
on the flag with one all-reduce per step so all of them stop after the same step.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from types import FrameType

from megatron_maspo.parallel import comm

logger = logging.getLogger(__name__)


class StopRequest:
    """Installs the handlers on construction; ``should_stop(group)`` is collective."""

    def __init__(self) -> None:
        self.requested: int | None = None
        self._prev = {}
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            # signal.signal raises ValueError outside the main thread (e.g. a test runner's thread).
            with contextlib.suppress(ValueError):
                self._prev[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C aborts at once
        self.requested = signum
        logger.warning("received %s: will checkpoint after the current step and stop",
                       signal.Signals(signum).name)

    def should_stop(self, group=None) -> bool:
        """Collective over ``group`` (default: the world): True on every rank if any rank got a signal."""
        return comm.any_true(self.requested is not None, group=group)

    def restore(self) -> None:
        """Reinstall the handlers that were active before."""
        for sig, h in self._prev.items():
            signal.signal(sig, h)

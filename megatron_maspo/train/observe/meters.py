"""One context for a named phase: its memory peak (``memory/*``) and its progress bar."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from megatron_maspo.train.observe.memory import PhaseMemory
from megatron_maspo.train.observe.progress import Advance, Progress


class PhaseMeters:
    """``with meters.phase("generate", n, "seq") as advance:`` meters memory and shows progress.

    ``progress`` is replaced when the run puts up its live bar (:meth:`Trainer.run`); the memory meter
    lives as long as the run.
    """

    def __init__(self, memory: PhaseMemory, progress: Progress | None = None) -> None:
        self.memory = memory
        self.progress = progress if progress is not None else Progress(total=0, enabled=False)

    @contextlib.contextmanager
    def phase(self, name: str, total: int | None = None, unit: str = "it") -> Iterator[Advance]:
        with self.memory.phase(name), self.progress.phase(name, total, unit) as advance:
            yield advance

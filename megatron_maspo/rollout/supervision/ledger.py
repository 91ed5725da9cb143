"""The work ledger of one rollout round: every prompt chunk is pending, running on one engine, or done.

Pure bookkeeping, no processes and no clock of its own (the caller passes ``now``), so every rule is
a unit test. A round is the step's prompts split into contiguous chunks (:func:`split_chunks`); an
engine asks for the next pending chunk (:meth:`WorkLedger.assign`), returns its completions
(:meth:`WorkLedger.complete`), or dies (:meth:`WorkLedger.fail`), which puts its running chunks back
at the head of the queue, in prompt order, for the next live engine.

Why chunks are contiguous and never re-cut: the built-in engine seeds each sample from the prompt's
position in the step (``SamplingParams.first_prompt`` + row), so a chunk re-issued whole to another
engine, with the same weights, repeats its completions exactly; re-cutting it would also give the same
samples, but a batch of another size is a different float computation, and exact equality is the point.

Every attempt carries the engine's restart epoch, so a late answer from an engine that has since been
declared dead (a hang that woke up) is refused instead of counted twice.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Chunk:
    """A contiguous run of the round's prompts, ``[start, stop)`` in round order."""

    index: int
    """Position of the chunk in the round (results are returned in this order)."""
    start: int
    stop: int

    @property
    def prompts(self) -> int:
        return self.stop - self.start


def split_chunks(num_prompts: int, num_chunks: int) -> list[Chunk]:
    """``num_prompts`` split into ``min(num_chunks, num_prompts)`` contiguous chunks, sizes differing by
    at most one (the larger first, as ``FleetLayout.shard`` splits a step over engines).

    Raises:
        ValueError: ``num_prompts < 1`` or ``num_chunks < 1``.
    """
    if num_prompts < 1 or num_chunks < 1:
        raise ValueError(f"split_chunks: {num_prompts} prompts into {num_chunks} chunks; both must be >= 1")
    n = min(num_chunks, num_prompts)
    base, extra = divmod(num_prompts, n)
    out, start = [], 0
    for i in range(n):
        stop = start + base + (i < extra)
        out.append(Chunk(i, start, stop))
        start = stop
    return out


@dataclass
class Attempt:
    """One chunk running on one engine incarnation."""

    chunk: Chunk
    engine: int
    epoch: int
    since: float
    """When it was handed over (``now`` of :meth:`WorkLedger.assign`): the work lost if it fails."""


@dataclass
class WorkLedger:
    """Pending, running and finished chunks of one round.

    Args:
        chunks: the round's chunks (:func:`split_chunks`).
    """

    chunks: list[Chunk]
    pending: deque[int] = field(init=False)
    running: dict[int, Attempt] = field(init=False, default_factory=dict)
    """chunk index -> its attempt."""
    done: dict[int, Any] = field(init=False, default_factory=dict)
    """chunk index -> the result its engine returned."""
    reissued_prompts: int = field(init=False, default=0)
    """Prompts put back in the queue because their engine failed (counted once per failure)."""
    reissued_chunks: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if [c.index for c in self.chunks] != list(range(len(self.chunks))):
            raise ValueError("WorkLedger: chunks must be indexed 0, 1, ... in order")
        self.pending = deque(c.index for c in self.chunks)

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.chunks)

    def running_on(self, engine: int) -> list[Attempt]:
        """The attempts of ``engine`` (any epoch), in chunk order."""
        return sorted((a for a in self.running.values() if a.engine == engine), key=lambda a: a.chunk.index)

    def assign(self, engine: int, epoch: int, now: float) -> Chunk | None:
        """Hand the next pending chunk to ``engine`` (restart epoch ``epoch``); None when none is pending."""
        if not self.pending:
            return None
        idx = self.pending.popleft()
        self.running[idx] = Attempt(self.chunks[idx], engine, epoch, now)
        return self.chunks[idx]

    def complete(self, index: int, engine: int, epoch: int, result: Any) -> bool:
        """Record the result of chunk ``index`` from ``engine`` at ``epoch``.

        Returns:
            False (and nothing changes) when that attempt is not the chunk's current one: the engine was
            declared failed since, and the chunk is pending again or already done elsewhere.
        """
        att = self.running.get(index)
        if att is None or (att.engine, att.epoch) != (engine, epoch):
            return False
        del self.running[index]
        self.done[index] = result
        return True

    def fail(self, engine: int) -> list[Attempt]:
        """``engine`` is gone: its running chunks go back to the head of the queue, in chunk order, ahead
        of the chunks never started (they are the oldest work of the round).

        Returns:
            The attempts lost (their ``since`` gives the work thrown away).
        """
        lost = self.running_on(engine)
        for att in lost:
            del self.running[att.chunk.index]
        self.pending.extendleft(a.chunk.index for a in reversed(lost))
        self.reissued_chunks += len(lost)
        self.reissued_prompts += sum(a.chunk.prompts for a in lost)
        return lost

    def results(self) -> list[Any]:
        """The results in chunk order.

        Raises:
            RuntimeError: the round is not finished (naming the chunks still missing).
        """
        if not self.finished:
            missing = [c.index for c in self.chunks if c.index not in self.done]
            raise RuntimeError(f"work ledger: chunks {missing} have no result yet")
        return [self.done[c.index] for c in self.chunks]

"""Fault injection for failure tests: raise, or feed NaN log-probs, on one chosen rank at one chosen step.

    MASPO_FAULT="rank=1,step=2,kind=raise"   # rank 1 raises InjectedFault when RL step 2 starts
    MASPO_FAULT="rank=1,step=2,kind=nan"     # rank 1's loss sees NaN log-probs during step 2
    MASPO_FAULT="rank=1,step=2,kind=flip_weight"   # rank 1's engine flips one bit of a parameter after
    MASPO_FAULT="rank=1,step=2,kind=stale_weight"  # loading the next sync from step 2 on (or keeps its
                                                    # previous value): the weight verification must stop it

The variable is read here and nowhere else, once per process; the loop holds a :class:`FaultInjector`
and asks it once per step. Unset (the normal case), nothing reaches the loss path. ``step`` counts RL steps from 1 like the console and ``metrics.jsonl``; ``rank``
is the global rank.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

ENV = "MASPO_FAULT"
KINDS = ("raise", "nan", "flip_weight", "stale_weight")


class InjectedFault(RuntimeError):
    """Raised by ``MASPO_FAULT=...,kind=raise``."""


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str


def parse_fault(text: str) -> Fault:
    """``"rank=1,step=2,kind=raise"`` -> Fault; ``ValueError`` naming what is wrong."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("rank", "step", "kind"):
            raise ValueError(f"{ENV}={text!r}: expected 'rank=R,step=S,kind={'|'.join(KINDS)}'")
        fields[key] = value.strip()
    if set(fields) != {"rank", "step", "kind"}:
        raise ValueError(f"{ENV}={text!r}: needs rank, step and kind")
    if fields["kind"] not in KINDS:
        raise ValueError(f"{ENV}={text!r}: kind must be one of {KINDS}")
    try:
        return Fault(rank=int(fields["rank"]), step=int(fields["step"]), kind=fields["kind"])
    except ValueError:
        raise ValueError(f"{ENV}={text!r}: rank and step must be integers") from None


@functools.cache
def configured() -> Fault | None:
    """The fault named by ``MASPO_FAULT``, or None."""
    text = os.environ.get(ENV, "").strip()
    return parse_fault(text) if text else None


class FaultInjector:
    """This rank's injected fault, asked once per RL step by the loop (no global state).

    ``at_step(s)`` raises :class:`InjectedFault` for ``kind=raise`` at step ``s`` on this rank, and for
    ``kind=nan`` returns the log-prob hook the actor applies during that step (None otherwise).
    """

    def __init__(self, fault: Fault | None, rank: int) -> None:
        self.fault = fault if fault is not None and fault.rank == rank else None

    def weight_fault(self, step: int) -> str | None:
        """``"flip"`` / ``"stale"`` for ``kind=flip_weight`` / ``stale_weight`` at ``step`` on this rank:
        the caller arms its engine (``Engine.inject_fault``) for the next sync it loads."""
        f = self.fault
        if f is None or f.step != step or not f.kind.endswith("_weight"):
            return None
        logger.warning("%s: the engine on rank %d will %s a parameter after its next sync", ENV, f.rank,
                       "corrupt" if f.kind == "flip_weight" else "not update")
        return f.kind.removesuffix("_weight")

    def at_step(self, step: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        f = self.fault
        if f is None or f.step != step or f.kind.endswith("_weight"):
            return None
        if f.kind == "raise":
            raise InjectedFault(f"{ENV}: injected exception on rank {f.rank} at step {f.step} "
                                f"(unix time {time.time():.3f})")
        return functools.partial(nan_at_first_token, step=step)


def nan_at_first_token(logprobs: torch.Tensor, mask: torch.Tensor, *, step: int = 0) -> torch.Tensor:
    """``logprobs`` [T] with NaN at its first valid (``mask``) token; unchanged when nothing is valid."""
    if not bool(mask.any()):
        return logprobs
    first = int(mask.nonzero()[0])
    logger.warning("%s: injecting NaN into log-probs at step %d", ENV, step)
    hit = torch.arange(logprobs.numel(), device=logprobs.device) == first
    return torch.where(hit, torch.full_like(logprobs, float("nan")), logprobs)

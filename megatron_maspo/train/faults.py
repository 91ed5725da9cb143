"""Fault injection for failure tests: raise, or feed NaN log-probs, on one chosen rank at one chosen step.

    MASPO_FAULT="rank=1,step=2,kind=raise"   # rank 1 raises InjectedFault when RL step 2 starts
    MASPO_FAULT="rank=1,step=2,kind=nan"     # rank 1's loss sees NaN log-probs during step 2

The variable is read here and nowhere else, once per process; unset (the normal case) every hook is a
no-op costing one attribute check. ``step`` counts RL steps from 1 like the console and ``metrics.jsonl``; ``rank``
is the global rank.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

ENV = "MASPO_FAULT"
KINDS = ("raise", "nan")


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


_current_step: int | None = None


def _mine(kind: str) -> bool:
    f = configured()
    if f is None or f.kind != kind or _current_step != f.step:
        return False
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return rank == f.rank


def at_step(step: int) -> None:
    """Mark the start of RL step ``step``; raises ``InjectedFault`` if a raise is injected here."""
    global _current_step
    _current_step = step
    if _mine("raise"):
        f = configured()
        raise InjectedFault(f"{ENV}: injected exception on rank {f.rank} at step {f.step} "
                            f"(unix time {time.time():.3f})")


def poison_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logprobs`` [T] with NaN at its first valid token if a NaN is injected in this step, else as is."""
    if not _mine("nan") or not bool(mask.any()):
        return logprobs
    first = int(mask.nonzero()[0])
    logger.warning("%s: injecting NaN into log-probs at step %d", ENV, _current_step)
    hit = torch.arange(logprobs.numel(), device=logprobs.device) == first
    return torch.where(hit, torch.full_like(logprobs, float("nan")), logprobs)

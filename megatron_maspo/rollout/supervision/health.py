"""Engine slots and the rules that judge them: when an engine is overdue, whether a restart is left,
and the one line a failure is logged with. Pure (``now`` is an argument), so each rule is unit-tested.

Detection is by progress, not by a heartbeat thread: an engine that owes something (it is starting,
loading weights, or generating a chunk) must report within ``rollout.engine_timeout_s`` of its last
report (``rollout.engine_start_timeout_s`` while it starts: imports, model build and, for vLLM, its
compilation). A heartbeat thread would keep beating while the engine's main thread is stuck in a
collective or a kernel; progress reports come from the decode loop itself (every decode step for the
built-in engine, every bucket while loading), so they stop exactly when the work stops. An idle engine
owes nothing and is not timed: a stop there is noticed as soon as it is given work.

A dead process (SIGKILL, OOM killer, a raised error) is noticed at once: its end of the link closes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SlotState(enum.Enum):
    STARTING = "starting"
    """Process spawned, engine being built; not yet reported ready."""
    LOADING = "loading"
    """Receiving the current weights (every bucket, then the digest check)."""
    IDLE = "idle"
    """Holds the current weights, verified; may take a chunk."""
    BUSY = "busy"
    """Generating a chunk."""
    DEAD = "dead"
    """Failed and not (yet) restarted."""


OWES_PROGRESS = (SlotState.STARTING, SlotState.LOADING, SlotState.BUSY)


def link_prefix(engine: int, epoch: int) -> str:
    """Name of one engine incarnation's links (a store prefix, a process name): a restart gets a fresh
    epoch, so nothing of the old links (keys, half-sent messages, a communicator) can be mistaken for
    the new one's."""
    return f"rollout_engines/e{engine}/epoch{epoch}"


@dataclass
class EngineSlot:
    """What the supervisor knows of one engine: the current incarnation (``epoch``) and its state."""

    engine: int
    epoch: int = 0
    state: SlotState = SlotState.DEAD
    last_report: float = 0.0
    """When the engine last reported progress (or changed state)."""
    pid: int | None = None
    host: str = "?"
    version: int = 0
    """Weight version it holds, verified (0 = none yet)."""
    chunk: int | None = None
    """Chunk index it is generating (BUSY)."""
    restarts: int = 0

    def mark(self, state: SlotState, now: float) -> None:
        self.state, self.last_report = state, now

    @property
    def label(self) -> str:
        return f"rollout engine {self.engine} (epoch {self.epoch})"


def overdue(slot: EngineSlot, now: float, *, timeout_s: float, start_timeout_s: float) -> str | None:
    """Why ``slot`` counts as hung at ``now`` (None: it is not). Only states that owe progress are timed."""
    if slot.state not in OWES_PROGRESS:
        return None
    limit, knob = ((start_timeout_s, "rollout.engine_start_timeout_s") if slot.state is SlotState.STARTING
                   else (timeout_s, "rollout.engine_timeout_s"))
    silent = now - slot.last_report
    if silent <= limit:
        return None
    what = {SlotState.STARTING: "starting", SlotState.LOADING: "loading weights",
            SlotState.BUSY: f"generating chunk {slot.chunk}"}[slot.state]
    return f"hung: no progress for {silent:.1f} s while {what} ({knob}={limit:g})"


def next_deadline(slots: list[EngineSlot], *, timeout_s: float, start_timeout_s: float) -> float | None:
    """The earliest time at which some slot becomes overdue (None: no slot is timed)."""
    times = [s.last_report + (start_timeout_s if s.state is SlotState.STARTING else timeout_s)
             for s in slots if s.state in OWES_PROGRESS]
    return min(times) if times else None


class RestartBudgetSpent(RuntimeError):
    """An engine failed with no restart left (``rollout.max_engine_restarts``); one line, naming both."""


@dataclass
class RestartBudget:
    """Restarts left for the whole job (not per engine: a fleet that keeps failing is a problem to stop
    on, whichever engine it is)."""

    limit: int
    used: int = 0

    def take(self) -> bool:
        """Spend one restart; False when none is left (nothing is spent)."""
        if self.used >= self.limit:
            return False
        self.used += 1
        return True


@dataclass
class EngineFailure:
    """One failure, as logged and as the metrics count it."""

    engine: int
    epoch: int
    host: str
    pid: int | None
    cause: str
    detected_at: float
    silent_s: float
    """Seconds between the engine's last report and the detection (the detection delay)."""
    lost_s: float = 0.0
    """Seconds of generation thrown away: from the hand-over of its oldest lost chunk to the detection."""
    prompts_reissued: int = 0
    restart_s: float | None = None
    """Seconds from detection until the restarted engine held the current weights (None: not restarted
    yet, or the budget was spent)."""
    extra: dict = field(default_factory=dict)

    @property
    def time_lost_s(self) -> float:
        """The failure's cost in engine-seconds: the work thrown away plus the time until the replacement
        held the current weights (once it does). The round itself waits less when other engines take
        the re-issued chunks meanwhile."""
        return self.lost_s + (self.restart_s or 0.0)


def failure_line(f: EngineFailure, *, restart: int | None, budget: int) -> str:
    """The one log line of a failure: engine, host, cause, what was re-issued, and the restart taken."""
    pid = f"pid {f.pid}" if f.pid is not None else "no pid"
    then = (f"restart {restart} of {budget} (rollout.max_engine_restarts)" if restart is not None
            else f"no restart left: rollout.max_engine_restarts={budget} spent")
    return (f"rollout engine {f.engine} on host {f.host} ({pid}, epoch {f.epoch}) failed: {f.cause}; "
            f"{f.prompts_reissued} prompts re-issued; {then}")

"""Elastic capacity: engines that join or leave a running job, asked for through files in its run directory.

    maspo engines add RUN_DIR [--owner E] [--from-step S] [--gpus 4,5]      (cli/engines.py)
    maspo engines drain RUN_DIR --engine E [--from-step S]
        -> RUN_DIR/engines/requests/0001-add-e2.json       one file per request, written whole (rename)
    each supervised owner of the rollout pool, at every batch boundary (before the batch of step s):
        its requests with from_step <= s, not yet applied by this process -> add_engine / drain
        -> RUN_DIR/engines/applied/0001-add-e2.json        the step it took effect at, or why it was refused

Why files: the run directory is already shared by every node of a job (its checkpoints and metrics live
there), it survives the job, and an operator can read and write it without a connection to any rank.
No collective is involved: an owner's supervisor and its engine processes are its own, so an owner that
grows or shrinks its fleet changes nothing another rank waits on.

The requests are the pool's desired shape, not events: a job resumed from a checkpoint applies every
request again at its first boundary, so the pool comes back at the size the operator left it.

Which step an engine serves first: a request is applied at the first batch boundary an owner reaches
with ``step >= from_step``. Batches are made ahead of training (``rollout.max_staleness = k``: the batch
of step s is started once the update of step s - k - 1 has been sent), so a request for the next step
that arrives late takes effect at the following boundary; ``applied/`` names the step it took.

A joined engine is a child of its owner: it runs on the owner's node (on GPUs, on the ``gpus`` it is
given), takes the owner's launch settings, and shares the job's restart budget. Pure functions here
except :class:`ControlDir`, whose only side effects are the files.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

VERBS = ("add", "drain")


@dataclass(frozen=True)
class EngineRequest:
    """One request: engine ``engine`` joins (``add``) or leaves (``drain``) owner ``owner``'s fleet."""

    seq: int
    """Order of the requests (the file name's number); applied in this order."""
    verb: str
    engine: int
    owner: int
    """The rollout-pool engine (its torchrun rank's engine id) whose supervisor runs it."""
    from_step: int = 0
    """The first step whose batch it may change (0: the next boundary)."""
    gpus: tuple[int, ...] | None = None
    """``add`` on GPUs: the node-local GPUs of the new engine (None: its owner's)."""

    def __post_init__(self) -> None:
        if self.verb not in VERBS:
            raise ValueError(f"engine request {self.seq}: verb {self.verb!r} is not one of {VERBS}")
        if self.engine < 0 or self.owner < 0 or self.from_step < 0 or self.seq < 1:
            raise ValueError(f"engine request {self.seq}: engine, owner, from_step must be >= 0 and seq >= 1")

    @property
    def name(self) -> str:
        return f"{self.seq:04d}-{self.verb}-e{self.engine}.json"


def fleet_of(requests: list[EngineRequest], engines: int) -> dict[int, int]:
    """Every engine the requests leave in the pool -> its owner, from the ``engines`` the job starts with
    (engine e owned by itself) and the requests in order (a drain of an absent engine changes nothing)."""
    fleet = {e: e for e in range(engines)}
    for r in sorted(requests, key=lambda r: r.seq):
        if r.verb == "add":
            fleet[r.engine] = r.owner
        else:
            fleet.pop(r.engine, None)
    return fleet


def next_engine_id(requests: list[EngineRequest], engines: int) -> int:
    """The id a new engine gets: one past every id used so far (a drained engine's id is never reused, so
    the metrics of two engines never share a key)."""
    return max([engines - 1, *(r.engine for r in requests)]) + 1


def default_owner(requests: list[EngineRequest], engines: int) -> int:
    """The owner with the fewest engines after the requests so far (the lowest id on a tie)."""
    counts = dict.fromkeys(range(engines), 0)
    for owner in fleet_of(requests, engines).values():
        counts[owner] += 1
    return min(counts, key=lambda o: (counts[o], o))


def due(requests: list[EngineRequest], *, owner: int, step: int, done: set[int]) -> list[EngineRequest]:
    """The requests owner ``owner`` applies at the boundary before the batch of ``step``: its own, due
    (``from_step <= step``), not yet in ``done`` (seqs applied or refused by this process), in order."""
    return sorted((r for r in requests if r.owner == owner and r.from_step <= step and r.seq not in done),
                  key=lambda r: r.seq)


class ControlDir:
    """``RUN_DIR/engines``: the requests (``requests/``) and what became of them (``applied/``)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.root = Path(run_dir) / "engines"
        self.requests_dir, self.applied_dir = self.root / "requests", self.root / "applied"

    def requests(self) -> list[EngineRequest]:
        """Every well-formed request in order; a malformed file is logged and skipped (an operator's
        typo must not stop a running job)."""
        out = []
        if not self.requests_dir.is_dir():
            return out
        for path in sorted(self.requests_dir.glob("*.json")):
            try:
                raw = json.loads(path.read_text())
                raw["gpus"] = tuple(raw["gpus"]) if raw.get("gpus") is not None else None
                out.append(EngineRequest(**raw))
            except (OSError, ValueError, TypeError, KeyError) as e:
                logger.warning("engine request %s skipped: %s", path, e)
        return sorted(out, key=lambda r: r.seq)

    def submit(self, verb: str, *, engine: int, owner: int, from_step: int = 0,
               gpus: tuple[int, ...] | None = None) -> EngineRequest:
        """Write a request under the next sequence number (exclusive create, then a rename: two
        operators at once get two numbers, and an owner never reads half a file)."""
        self.requests_dir.mkdir(parents=True, exist_ok=True)
        seq = max((r.seq for r in self.requests()), default=0) + 1
        while True:
            req = EngineRequest(seq=seq, verb=verb, engine=engine, owner=owner, from_step=from_step, gpus=gpus)
            claim = self.requests_dir / f".{seq:04d}.claim"
            try:
                fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                seq += 1
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(req), f)
            os.replace(claim, self.requests_dir / req.name)
            return req

    def record(self, req: EngineRequest, *, step: int, ok: bool, detail: str = "") -> None:
        """What became of ``req``: applied before the batch of ``step``, or refused with ``detail``."""
        self.applied_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.applied_dir / f".{req.name}.tmp"
        tmp.write_text(json.dumps({**asdict(req), "step": step, "ok": ok, "detail": detail}))
        os.replace(tmp, self.applied_dir / req.name)

    def outcomes(self) -> dict[int, dict]:
        """seq -> the recorded outcome (``step``, ``ok``, ``detail``)."""
        out = {}
        if self.applied_dir.is_dir():
            for path in self.applied_dir.glob("*.json"):
                try:
                    rec = json.loads(path.read_text())
                    out[int(rec["seq"])] = rec
                except (OSError, ValueError, KeyError):
                    continue
        return out


class ElasticOwner:
    """A supervised owner's side: at every batch boundary, apply its due requests to its supervisor.

    Args:
        control: the run's :class:`ControlDir`.
        owner: this owner's engine id.
        supervisor: its :class:`~.supervisor.EngineSupervisor` (``add_engine`` / ``drain``).
    """

    def __init__(self, control: ControlDir, *, owner: int, supervisor: Any) -> None:
        self.control, self.owner, self.supervisor = control, owner, supervisor
        self.done: set[int] = set()

    def at_boundary(self, step: int) -> list[str]:
        """Apply what is due before the batch of ``step``; returns one line per request (also logged)."""
        lines = []
        for req in due(self.control.requests(), owner=self.owner, step=step, done=self.done):
            self.done.add(req.seq)
            try:
                if req.verb == "add":
                    self.supervisor.add_engine(req.engine, gpus=req.gpus)
                    line = f"rollout engine {req.engine} joined owner {self.owner}'s fleet before step {step}"
                else:
                    self.supervisor.drain(req.engine)
                    line = f"rollout engine {req.engine} drained from owner {self.owner}'s fleet before step {step}"
                ok, detail = True, ""
            except ValueError as e:  # not ours to apply (absent engine, the last one): refused, job goes on
                ok, detail = False, str(e)
                line = f"engine request {req.name} refused before step {step}: {e}"
            (logger.info if ok else logger.warning)(line)
            self.control.record(req, step=step, ok=ok, detail=detail)
            lines.append(line)
        return lines

"""The supervisor: runs each rollout engine in an OS process of its own and keeps the fleet serving.

    start()                     spawn every engine (epoch 0)
    load_weights(named, v)      every live engine loads version v (digests per rollout.verify_every);
                                the tensors are kept: a restarted engine gets them again, whole, with full
                                digests, and takes no work before they check out
    generate(prompts, params)   the round split into chunks (ledger.py), handed to idle engines; a failed
                                engine's chunks go back to the queue and to the next live engine
    add_engine(e) / drain(e)    between rounds: an engine joins (sent the current weights whole, like a
                                restarted one) or leaves the fleet (elastic capacity, elastic.py)
    metrics() / close()

One loop (:meth:`_pump`) does all of it: it waits on every engine's link and process sentinel with a
timeout no later than the next progress deadline (health.py), so a death is seen at once and a hang
within ``rollout.engine_timeout_s`` plus one poll (at most a quarter of that timeout, capped at 1 s).
A failure is logged in one line (engine, host, cause), the process is killed (SIGKILL: a stopped process
cannot ignore it), and a new incarnation is spawned with the next epoch, its own fresh pipes, until
``rollout.max_engine_restarts`` restarts have been used in the job; the next failure then raises
:class:`~.health.RestartBudgetSpent` with one line naming the engine and the budget.

Writes to an engine never block the loop: each incarnation has a sender thread with an outbox, so
weights going to an engine that has stopped (SIGSTOP) block only that thread, which ends with a
broken pipe when the engine is killed.

Determinism: every chunk is generated with the weights of the round's version and seeded per prompt
(``SamplingParams.first_prompt`` = the chunk's first prompt), so which engine makes a chunk, and how
often it was re-issued, does not change its completions (built-in engine; vLLM seeds a call, not a
prompt: docs/engine-faults.md).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from multiprocessing.connection import wait as wait_any
from typing import Any

import torch

from megatron_maspo.errors import WeightVerifyError
from megatron_maspo.rollout import digest
from megatron_maspo.rollout.buckets import bucket_to_wire, pack_buckets
from megatron_maspo.rollout.supervision.engine_process import (
    EngineLaunch,
    engine_main,
    recv,
    send,
    with_epoch,
)
from megatron_maspo.rollout.supervision.health import (
    EngineFailure,
    EngineSlot,
    RestartBudget,
    RestartBudgetSpent,
    SlotState,
    failure_line,
    link_prefix,
    next_deadline,
    overdue,
)
from megatron_maspo.rollout.supervision.ledger import WorkLedger, split_chunks
from megatron_maspo.rollout.types import Completion, SamplingParams

logger = logging.getLogger(__name__)

Hook = Callable[[str, EngineSlot], None]
_HOST = socket.gethostname()


_LIVE: weakref.WeakSet = weakref.WeakSet()
"""Every incarnation not killed yet: ended at interpreter exit, before ``multiprocessing`` would join them
(the engine processes are not daemonic, so that vLLM can start its own processes inside them)."""


@atexit.register
def _kill_live() -> None:
    for link in list(_LIVE):
        link.kill()


class _Link:
    """One incarnation's process (leading its own process group) and its two one-way pipes, with a sender
    thread for the parent's side."""

    def __init__(self, ctx: Any, launch: EngineLaunch) -> None:
        to_child_r, self._to_child = ctx.Pipe(duplex=False)
        self.inbox, from_child_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=engine_main, args=(to_child_r, from_child_w, launch),
                                name=link_prefix(launch.engine, launch.epoch), daemon=False)
        self.proc.start()
        _LIVE.add(self)
        to_child_r.close()  # the child's ends: closed here, so the child's death reads as EOF
        from_child_w.close()
        self._outbox: queue.Queue = queue.Queue()
        self.broken = False
        self._thread = threading.Thread(target=self._drain, name=f"{self.proc.name}-send", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                send(self._to_child, msg)
            except OSError:  # the engine is gone: the loop notices through its sentinel / EOF
                self.broken = True
                return

    def post(self, msg: tuple) -> None:
        self._outbox.put(msg)

    def kill(self) -> None:
        """End the incarnation now, with every process it started (its group), and release its pipes
        (never waits on the engine's cooperation)."""
        _LIVE.discard(self)
        with contextlib.suppress(OSError):  # the group is gone already, or not made yet (then the pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        self.proc.join(10)
        self._outbox.put(None)
        for c in (self._to_child, self.inbox):
            with contextlib.suppress(OSError):
                c.close()

    def exit_cause(self) -> str:
        """How the process ended, once it has (the signal's name, or the exit code)."""
        self.proc.join(1)
        code = self.proc.exitcode
        if code is None:
            return "link closed while the process still runs"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


class EngineSupervisor:
    """A fleet of engines, each in a process and failure domain of its own.

    Args:
        launch: the launch of the first engine, epoch 0 (``EngineLaunch``); engine ``e`` gets ``engine=e``.
        num_engines: engines to run, numbered ``first_engine``, ``first_engine + 1``, ...
        timeout_s, start_timeout_s, max_restarts: ``rollout.engine_timeout_s``,
            ``rollout.engine_start_timeout_s``, ``rollout.max_engine_restarts``.
        verify_every: ``rollout.verify_every`` resolved (digests of regular syncs); re-sends after a
            restart are always digested in full.
        bucket_mb: weight bucket size (``rollout.bucket_mb``).
        faults: failure tests: ``{engine: EngineLaunch.fault}``.
        hook: called as ``hook(event, slot)`` for ``"ready"``, ``"progress"``, ``"loaded"``, ``"failed"``
            (tests use it to kill an engine in the middle of a chunk).
        first_engine: the number of the first engine (a rollout-pool owner supervises its own engine id).
    """

    def __init__(self, launch: EngineLaunch, num_engines: int, *, timeout_s: float, start_timeout_s: float,
                 max_restarts: int, verify_every: int = 1, bucket_mb: float = 64.0,
                 faults: dict[int, dict] | None = None, hook: Hook | None = None,
                 first_engine: int = 0) -> None:
        if num_engines < 1:
            raise ValueError(f"EngineSupervisor: num_engines must be >= 1, got {num_engines}")
        ids = range(first_engine, first_engine + num_engines)
        self._faults = dict(faults or {})
        self._base = launch
        self._launches = {e: dataclasses.replace(launch, engine=e, epoch=0, fault=self._faults.get(e)) for e in ids}
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.budget = RestartBudget(max_restarts)
        self.verify_every, self.bucket_bytes = verify_every, int(bucket_mb * 2**20)
        self.hook = hook
        self.poll_s = min(1.0, timeout_s / 4)
        self.slots = [EngineSlot(e) for e in ids]
        self._by_id = {s.engine: s for s in self.slots}
        self._links: dict[int, _Link] = {}
        self._ctx = mp.get_context("spawn")  # a fork would copy the trainer's threads and CUDA state
        self._weights: list[tuple[str, torch.Tensor]] | None = None
        self._version = 0
        self._syncs = 0
        self._ledger: WorkLedger | None = None
        self._round_params: SamplingParams | None = None
        self._prompts: list[list[int]] = []
        self.failures: list[EngineFailure] = []
        self._reported = 0  # failures already in a metrics() call
        self._restart_of: dict[int, EngineFailure] = {}  # engine -> the failure its restart answers
        self._made: dict[int, int] = {}
        """Prompts each engine made since the last :meth:`metrics` call (chunks it completed)."""
        self.joined = self.drained = 0

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        """Spawn every engine and wait until each has reported ready."""
        for slot in self.slots:
            self._spawn(slot)
        self._pump(lambda: all(s.state is SlotState.IDLE for s in self.slots))

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Every engine loads ``named`` (full HF-named CPU tensors) as weight ``version`` and checks it.

        Raises:
            WeightVerifyError: an engine holds something else than ``named`` after loading.
            RestartBudgetSpent: an engine failed with no restart left.
        """
        self._weights = [(n, t.detach().cpu()) for n, t in named]
        self._version, self._syncs = version, self._syncs + 1
        plan = digest.plan(self._syncs - 1, self.verify_every)
        for slot in self.slots:
            if slot.state is SlotState.IDLE:
                self._send_weights(slot, plan)
        self._pump(self._all_current)

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 num_chunks: int | None = None) -> list[list[Completion]]:
        """``params.n`` completions per prompt, made by the engines of the fleet with the current weights.

        Args:
            prompts: the round's prompts (``[P]`` token-id lists).
            params: sampling settings; ``params.first_prompt`` is the position of ``prompts[0]`` in the
                step (chunk ``[a, b)`` is generated with ``first_prompt + a``).
            num_chunks: work items the round is split into (default: one per engine). More chunks lose
                less work per failure and balance a slow engine, at a little batching efficiency.

        Returns:
            ``[P][n]`` completions in prompt order, each with ``policy_version`` = the current version.
        """
        if self._weights is None:
            raise RuntimeError("EngineSupervisor.generate before load_weights: the engines hold no weights")
        self._ledger = WorkLedger(split_chunks(len(prompts), num_chunks or len(self.slots)))
        self._prompts, self._round_params = prompts, params
        try:
            self._pump(lambda: self._ledger.finished)
            return [c for part in self._ledger.results() for c in part]
        finally:
            self._ledger = None

    def add_engine(self, engine: int, *, gpus: tuple[int, ...] | None = None, wait: bool = True) -> None:
        """Engine ``engine`` joins the fleet (between rounds): spawned as epoch 0 with this fleet's launch
        settings, it is sent the current weights whole with full digests, as a restarted engine is, and
        takes chunks once it holds them. Its failures draw on the same restart budget.

        Args:
            gpus: its node-local GPUs (None: the first engine's; on GPUs give free ones).
            wait: return only once it holds the current weights (or is ready, before the first load), so
                the next round can count on it; a failure while it starts is handled as any other.

        Raises:
            ValueError: ``engine`` is in the fleet already.
            RuntimeError: called while a round runs.
        """
        if self._ledger is not None:
            raise RuntimeError("EngineSupervisor.add_engine during a round: engines join between rounds")
        if engine in self._by_id:
            raise ValueError(f"rollout engine {engine} is in the fleet already")
        self._launches[engine] = dataclasses.replace(self._base, engine=engine, epoch=0,
                                                     gpus=self._base.gpus if gpus is None else tuple(gpus),
                                                     fault=self._faults.get(engine))
        slot = EngineSlot(engine)
        self.slots.append(slot)
        self._by_id[engine] = slot
        self._spawn(slot)
        self.joined += 1
        if wait:
            self._pump(lambda: slot.state is SlotState.IDLE
                       and (self._weights is None or slot.version == self._version))

    def drain(self, engine: int) -> None:
        """Engine ``engine`` leaves the fleet (between rounds): asked to stop, then killed with its
        process group if it has not exited within 5 s. It owes nothing then, so no work is lost.

        Raises:
            ValueError: ``engine`` is not in the fleet, or is its last engine (a fleet of none makes
                nothing: the pool would wait forever).
            RuntimeError: called while a round runs.
        """
        if self._ledger is not None:
            raise RuntimeError("EngineSupervisor.drain during a round: engines leave between rounds")
        slot = self._by_id.get(engine)
        if slot is None:
            raise ValueError(f"rollout engine {engine} is not in this fleet (engines {sorted(self._by_id)})")
        if len(self.slots) == 1:
            raise ValueError(f"rollout engine {engine} is the last engine of its fleet: it cannot be drained")
        self.slots.remove(slot)
        del self._by_id[engine], self._launches[engine]
        self._restart_of.pop(engine, None)
        link = self._links.pop(engine, None)
        if link is not None:
            link.post(("stop",))
            link.proc.join(5.0)
            link.kill()
        slot.state = SlotState.DEAD
        self.drained += 1

    def engines(self) -> list[int]:
        """The engines of the fleet now, in the order they take work."""
        return [s.engine for s in self.slots]

    def metrics(self) -> dict[str, float]:
        """``rollout/engine_restarts`` and ``rollout/prompts_reissued`` (job totals),
        ``rollout/engines_live`` (engines holding the current weights now) and, over the failures since
        the last call, ``rollout/engine_failures``, ``rollout/engine_time_lost_s`` (engine-seconds of
        capacity lost: the work thrown away plus the time until the replacement held the current
        weights, where it already does) and ``rollout/engine_detect_s_max`` (last report to detection);
        elastic capacity: ``rollout/engines_joined`` / ``rollout/engines_drained`` (job totals) and
        ``rollout/engine_prompts/e<id>``, the prompts each engine of the fleet made since the last call
        (its share of the work)."""
        new = self.failures[self._reported:]
        self._reported = len(self.failures)
        made = {f"rollout/engine_prompts/e{e}": float(self._made.get(e, 0))
                for e in sorted({*self._by_id, *self._made})}
        self._made = {}
        return {**made, "rollout/engines_joined": float(self.joined), "rollout/engines_drained": float(self.drained),
                "rollout/engine_restarts": float(self.budget.used),
                "rollout/prompts_reissued": float(sum(f.prompts_reissued for f in self.failures)),
                "rollout/engines_live": float(sum(self._serving(s) for s in self.slots)),
                "rollout/engine_failures": float(len(new)),
                "rollout/engine_time_lost_s": sum(f.time_lost_s for f in new),
                "rollout/engine_detect_s_max": max((f.silent_s for f in new), default=0.0)}

    def pids(self) -> dict[int, int | None]:
        """The current process id of every engine (None while none runs)."""
        return {e: (link.proc.pid if link.proc.is_alive() else None) for e, link in self._links.items()}

    def close(self) -> None:
        """Stop every engine: ask, wait a little, then kill what is left. Nothing keeps running."""
        for link in self._links.values():
            link.post(("stop",))
        deadline = time.monotonic() + 5.0
        for link in self._links.values():
            link.proc.join(max(0.0, deadline - time.monotonic()))
        for link in self._links.values():
            link.kill()
        self._links.clear()
        for slot in self.slots:
            slot.state = SlotState.DEAD

    def __enter__(self) -> EngineSupervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop
    def _serving(self, slot: EngineSlot) -> bool:
        return slot.state in (SlotState.IDLE, SlotState.BUSY) and slot.version == self._version

    def _all_current(self) -> bool:
        return all(s.state is SlotState.IDLE and s.version == self._version for s in self.slots)

    def _pump(self, done: Callable[[], bool]) -> None:
        while True:
            self._dispatch()
            if done():
                return
            links = {link.inbox: e for e, link in self._links.items()}
            sentinels = {link.proc.sentinel: e for e, link in self._links.items()}
            now = time.monotonic()
            due = next_deadline(self.slots, timeout_s=self.timeout_s, start_timeout_s=self.start_timeout_s)
            wait_s = self.poll_s if due is None else min(self.poll_s, max(0.0, due - now) + 0.01)
            for ready in wait_any([*links, *sentinels], timeout=wait_s):
                e = links.get(ready, sentinels.get(ready))
                link = self._links.get(e)
                if link is None or self._by_id[e].state is SlotState.DEAD:
                    continue
                if ready is link.inbox:
                    self._read(self._by_id[e])
                elif ready == link.proc.sentinel:
                    # the process ended: read what it sent last (its error), else name the exit
                    self._drain_dead(self._by_id[e])
                # else: an object of an incarnation replaced in this pass (it failed already)
            for e, link in list(self._links.items()):
                # its exit status, not EOF alone: a process the engine forked (vLLM's engine core) inherits
                # the pipes and the sentinel and keeps them open after the engine itself is dead
                if self._by_id[e].state is not SlotState.DEAD and link.proc.exitcode is not None:
                    self._drain_dead(self._by_id[e])
            now = time.monotonic()
            for slot in self.slots:
                cause = overdue(slot, now, timeout_s=self.timeout_s, start_timeout_s=self.start_timeout_s)
                if cause is not None:
                    self._fail(slot, cause)

    def _read(self, slot: EngineSlot) -> None:
        link = self._links.get(slot.engine)
        if link is None or slot.state is SlotState.DEAD:
            return
        try:
            msg = recv(link.inbox)
        except (EOFError, OSError):
            self._fail(slot, link.exit_cause())
            return
        self._handle(slot, msg)

    def _drain_dead(self, slot: EngineSlot) -> None:
        link = self._links[slot.engine]
        while slot.state is not SlotState.DEAD and link.inbox.poll():
            self._read(slot)
        if slot.state is not SlotState.DEAD:
            self._fail(slot, link.exit_cause())

    def _handle(self, slot: EngineSlot, msg: tuple) -> None:
        now = time.monotonic()
        kind = msg[0]
        if kind == "ready":
            slot.pid, slot.host = msg[1], msg[2]
            slot.mark(SlotState.IDLE, now)
            if self._weights is not None:  # a restart: the current weights, whole, fully digested
                self._send_weights(slot, digest.plan(0, 1))
        elif kind == "progress":
            slot.last_report = now
        elif kind == "loaded":
            slot.version = msg[1]
            slot.mark(SlotState.IDLE, now)
            f = self._restart_of.pop(slot.engine, None)
            if f is not None:
                f.restart_s = now - f.detected_at
        elif kind == "result":
            if self._ledger is not None and self._ledger.complete(msg[1], slot.engine, slot.epoch, msg[2]):
                self._made[slot.engine] = self._made.get(slot.engine, 0) + self._ledger.chunks[msg[1]].prompts
            slot.chunk = None
            slot.mark(SlotState.IDLE, now)
        elif kind == "error":
            self._fail(slot, msg[1])
            return
        elif kind == "verify_error":
            self.close()
            raise WeightVerifyError(msg[1])
        if self.hook is not None:
            self.hook(kind, slot)

    def _dispatch(self) -> None:
        """Idle engines holding the current weights take the next pending chunks."""
        if self._ledger is None:
            return
        now = time.monotonic()
        for slot in self.slots:
            if slot.state is not SlotState.IDLE or slot.version != self._version:
                continue
            chunk = self._ledger.assign(slot.engine, slot.epoch, now)
            if chunk is None:
                return
            params = dataclasses.replace(self._round_params,
                                         first_prompt=self._round_params.first_prompt + chunk.start)
            slot.chunk = chunk.index
            slot.mark(SlotState.BUSY, now)
            self._links[slot.engine].post(("generate", chunk.index, self._prompts[chunk.start:chunk.stop],
                                           params))

    def _send_weights(self, slot: EngineSlot, plan: Any) -> None:
        wires = [bucket_to_wire(b) for b in pack_buckets(self._weights, self.bucket_bytes, digests=plan)]
        link = self._links[slot.engine]
        link.post(("load", self._version, len(wires)))
        for w in wires:
            link.post(("bucket", w))
        slot.mark(SlotState.LOADING, time.monotonic())

    def _spawn(self, slot: EngineSlot) -> None:
        launch = with_epoch(self._launches[slot.engine], slot.epoch)
        self._links[slot.engine] = _Link(self._ctx, launch)
        # the engine runs on this host; its "ready" confirms the name (and it is known if it never gets there)
        slot.pid, slot.host, slot.version, slot.chunk = self._links[slot.engine].proc.pid, _HOST, 0, None
        slot.mark(SlotState.STARTING, time.monotonic())

    def _fail(self, slot: EngineSlot, cause: str) -> None:
        """Log the failure, re-queue its chunks, kill the process, restart it (or raise past the budget)."""
        now = time.monotonic()
        lost = self._ledger.fail(slot.engine) if self._ledger is not None else []
        f = EngineFailure(engine=slot.engine, epoch=slot.epoch, host=slot.host, pid=slot.pid, cause=cause,
                          detected_at=now, silent_s=now - slot.last_report,
                          lost_s=now - min((a.since for a in lost), default=now),
                          prompts_reissued=sum(a.chunk.prompts for a in lost))
        self.failures.append(f)
        self._links.pop(slot.engine).kill()
        slot.state, slot.chunk = SlotState.DEAD, None
        if self.hook is not None:
            self.hook("failed", slot)
        if not self.budget.take():
            line = failure_line(f, restart=None, budget=self.budget.limit)
            logger.error(line)
            self.close()
            raise RestartBudgetSpent(line)
        logger.warning(failure_line(f, restart=self.budget.used, budget=self.budget.limit))
        slot.epoch += 1
        slot.restarts += 1
        self._restart_of[slot.engine] = f
        self._spawn(slot)

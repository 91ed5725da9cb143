"""A pool of grading processes with a hard per-item deadline that survives crashes and hangs.

Why not ``concurrent.futures.ProcessPoolExecutor``: one hung or dead worker breaks the whole executor
(``BrokenProcessPool``) and a running task cannot be cancelled. Here each worker owns a pipe; the parent
dispatches one item at a time per worker, waits on all pipes with the nearest deadline as timeout, and

- on a deadline overrun kills that worker (SIGKILL), scores the item ``TIMEOUT`` and starts a replacement;
- on EOF (the worker died: segfault, ``os._exit``, OOM kill) scores the item ``CRASH`` and replaces it;
- recycles a worker whose RSS passes ``max_worker_rss_mb`` or that served ``max_tasks_per_worker`` items.

Workers warm up (imports, math-verify's lazy init) before announcing themselves ready, so the deadline
only measures grading. The grade function must be a module-level callable (it is pickled by reference)
returning a ``GradeStatus``, or ``(GradeStatus, note)`` where ``note`` says why (e.g. the type a user grader
returned); exceptions inside it score ``ERROR`` without killing the worker (the note is the exception's type).
A whole ``map`` call may also have a deadline: items not graded by then score ``TIMEOUT``.

Per-item failures are not logged here (a slow grader would print one line per item): the caller reads
``last_notes`` and logs one summary per batch. Start-up failures name the grader (``name``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import resource
import signal
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import psutil

from megatron_maspo.errors import GraderError
from megatron_maspo.reward.base import GradeStatus

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0
_MAX_CONSECUTIVE_STARTUP_FAILURES = 3


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _on_alarm(signum: int, frame: Any) -> None:
    raise TimeoutError("warm-up call overran")


def _warm_up(grade_fn: Callable[..., Any], args: tuple, timeout_s: float, name: str) -> None:
    """One throw-away call, interrupted after ``timeout_s`` by SIGALRM (this is the worker's main thread).

    A failing or sleeping warm-up must not stop the worker: the real items then fail, are counted and
    hit the batch's limits. A hang that ignores the alarm (C code) ends in the pool's start-up timeout.
    """
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        grade_fn(*args)
    except Exception as e:
        logger.warning("grader %s: warm-up call failed (%s: %s)", name, type(e).__name__, e)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _worker_main(
    conn: Connection,
    grade_fn: Callable[..., GradeStatus],
    warmup: tuple | None,
    address_space_mb: int,
    name: str = "grader",
    warmup_timeout_s: float = 5.0,
) -> None:
    """Worker loop: cap memory, warm up, say ready, then grade ``(idx, args)`` until ``None``."""
    from megatron_maspo.parallel.orphans import die_with_parent

    die_with_parent()  # the trainer (or the fork server, which ends with it) SIGKILLed: end too
    if address_space_mb:
        # One item allocating gigabytes (a huge power, a giant matrix) gets a MemoryError here, scored
        # ERROR, instead of pushing the node into swap or the OOM killer. Virtual size, hence generous.
        limit = address_space_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if warmup is not None:
        _warm_up(grade_fn, warmup, warmup_timeout_s, name)
    conn.send(("ready", _rss_mb()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the trainer is gone: nothing to report, no traceback
            return
        if msg is None:
            return
        idx, args = msg
        note = ""
        try:
            out = grade_fn(*args)
            status, note = (GradeStatus(out[0]), str(out[1])) if isinstance(out, tuple) else (
                GradeStatus(out), "")
        except Exception as e:  # MemoryError, RecursionError, parser bugs: the item is wrong, not the run
            status, note = GradeStatus.ERROR, f"raised {type(e).__name__}"
        conn.send((idx, status, note, _rss_mb()))


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    item: int | None = None
    deadline: float = 0.0
    served: int = 0


class GraderPool:
    """Grades items in parallel worker processes; see the module docstring for the failure model.

    Args:
        grade_fn: module-level ``fn(*args) -> GradeStatus``.
        num_workers: number of processes.
        timeout_s: hard deadline per item, from dispatch to a ready worker.
        start_method: ``"forkserver"``, ``"spawn"`` or ``"fork"``.
        warmup: arguments of one throw-away call each worker makes before taking items.
        preload: modules the fork server imports once (forkserver only), e.g. the grader's module.
        max_worker_rss_mb: recycle a worker above this resident size.
        max_tasks_per_worker: recycle a worker after this many items; 0 = never.
        address_space_mb: ``RLIMIT_AS`` of each worker in MiB; 0 = unlimited.
        name: the grader's name in start-up errors (``"math-verify"``, ``"my_rewards:exact"``).
        startup_timeout_s: a worker not ready (imports, warm-up call) after this raises ``GraderError``.
    """

    def __init__(
        self,
        grade_fn: Callable[..., GradeStatus],
        *,
        num_workers: int,
        timeout_s: float,
        start_method: str = "forkserver",
        warmup: tuple | None = None,
        preload: Sequence[str] = (),
        max_worker_rss_mb: int = 1024,
        max_tasks_per_worker: int = 0,
        address_space_mb: int = 0,
        name: str = "grader",
        startup_timeout_s: float = _STARTUP_TIMEOUT_S,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver" and preload:
            self._ctx.set_forkserver_preload(list(preload))
        self._grade_fn = grade_fn
        self._timeout_s = timeout_s
        self._warmup = warmup
        self._max_rss_mb = max_worker_rss_mb
        self._max_tasks = max_tasks_per_worker
        self._address_space_mb = address_space_mb
        self.name = name
        self._startup_timeout_s = startup_timeout_s
        self.last_notes: Counter[str] = Counter()
        """Why items of the last ``map`` call failed: ``"<status>: <note>"`` -> count."""
        self.events: Counter[str] = Counter()
        """Lifetime counts: ``timeout``, ``crash``, ``recycled``, ``started``."""
        self._workers: list[_Worker] = [self._start() for _ in range(num_workers)]

    # -- lifecycle -------------------------------------------------------------------------------
    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main,
            args=(child, self._grade_fn, self._warmup, self._address_space_mb, self.name,
                  self._timeout_s),
            daemon=True,
        )
        proc.start()
        child.close()  # so the parent sees EOF when the worker dies
        self.events["started"] += 1
        return _Worker(proc=proc, conn=parent)

    def _kill(self, w: _Worker) -> None:
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=5)
        w.conn.close()

    def _replace(self, w: _Worker) -> None:
        self._kill(w)
        self._workers[self._workers.index(w)] = self._start()

    def close(self) -> None:
        """Stop all workers (graceful, then killed after 2 s)."""
        for w in self._workers:
            with contextlib.suppress(OSError):  # the worker may already be gone
                w.conn.send(None)
        for w in self._workers:
            w.proc.join(timeout=2)
            self._kill(w)
        self._workers = []

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def worker_pids(self) -> list[int]:
        """PIDs of the current workers (replacements change them)."""
        return [w.proc.pid for w in self._workers]

    # -- grading ---------------------------------------------------------------------------------
    def map(self, items: Sequence[tuple], *,
            progress: Callable[[int], None] | None = None,
            deadline_s: float | None = None) -> list[GradeStatus]:
        """Grade every ``items[i]`` (the argument tuple of ``grade_fn``); returns ``[len(items)]``.

        Never raises for a bad item: overruns score ``TIMEOUT``, dead workers ``CRASH``.
        ``progress(k)``, when given, is called as ``k`` more items get their status.
        ``deadline_s``, when given, bounds the whole call from the first dispatch (worker start-up
        is not counted): items still pending or in flight then score ``TIMEOUT``.

        Raises:
            GraderError: workers cannot start (the grader module fails to import, its warm-up call
                crashes or hangs); the message names the grader.
        """
        if not self._workers:
            raise RuntimeError("GraderPool is closed")
        results: list[GradeStatus | None] = [None] * len(items)
        self.last_notes = Counter()
        pending = deque(range(len(items)))
        startup_failures = 0
        reported = 0
        batch_end: float | None = None
        while pending or any(w.item is not None for w in self._workers):
            if batch_end is not None and time.monotonic() > batch_end:
                self._expire(results, pending, deadline_s)
                break
            if progress is not None and (done := len(items) - results.count(None)) > reported:
                progress(done - reported)
                reported = done
            for w in list(self._workers):
                if w.ready and w.item is None and pending:
                    idx = pending.popleft()
                    try:
                        w.conn.send((idx, items[idx]))
                    except OSError:  # died while idle (e.g. OOM-killed): not this item's fault
                        pending.appendleft(idx)
                        self.events["crash"] += 1
                        self._replace(w)
                        continue
                    w.item, w.deadline = idx, time.monotonic() + self._timeout_s
                    if batch_end is None and deadline_s is not None:
                        batch_end = time.monotonic() + deadline_s
            now = time.monotonic()
            deadlines = [w.deadline for w in self._workers if w.item is not None]
            if batch_end is not None:
                deadlines.append(batch_end)
            wait_s = max(0.0, min(deadlines) - now) if deadlines else 1.0
            for conn in wait([w.conn for w in self._workers], timeout=wait_s):
                w = next(w for w in self._workers if w.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if w.item is not None:
                        results[w.item] = GradeStatus.CRASH
                        self.events["crash"] += 1
                        self.last_notes[f"crash: worker exit code {w.proc.exitcode}"] += 1
                    elif w.ready:  # died while idle: replace it, no item lost
                        self.events["crash"] += 1
                    else:
                        startup_failures += 1
                        if startup_failures >= _MAX_CONSECUTIVE_STARTUP_FAILURES:
                            raise GraderError(
                                f"grader {self.name}: workers died {startup_failures} times before "
                                f"becoming ready (exit code {w.proc.exitcode}); check that it imports"
                            ) from None
                    self._replace(w)
                    continue
                if msg[0] == "ready":
                    w.ready, startup_failures = True, 0
                    continue
                idx, status, note, rss_mb = msg
                results[idx] = status
                if note:
                    self.last_notes[f"{status.value}: {note}"] += 1
                w.item, w.served = None, w.served + 1
                if rss_mb > self._max_rss_mb or (self._max_tasks and w.served >= self._max_tasks):
                    self.events["recycled"] += 1
                    self._replace(w)
            now = time.monotonic()
            for w in list(self._workers):
                if w.item is not None and now > w.deadline:
                    results[w.item] = GradeStatus.TIMEOUT
                    self.events["timeout"] += 1
                    self.last_notes[f"timeout: over {self._timeout_s:g} s per item"] += 1
                    self._replace(w)
                elif not w.ready and now - w.started > self._startup_timeout_s:
                    raise GraderError(
                        f"grader {self.name}: worker {w.proc.pid} not ready after "
                        f"{self._startup_timeout_s:g} s (its import or warm-up call hangs)"
                    )
        assert all(r is not None for r in results)
        if progress is not None and len(items) > reported:
            progress(len(items) - reported)
        return results  # type: ignore[return-value]

    def _expire(self, results: list, pending: deque, deadline_s: float | None) -> None:
        """The batch deadline passed: score what is pending or in flight ``TIMEOUT``, kill busy workers."""
        late = list(pending)
        pending.clear()
        for w in list(self._workers):
            if w.item is not None:
                late.append(w.item)
                self.events["timeout"] += 1
                self._replace(w)
        for idx in late:
            results[idx] = GradeStatus.TIMEOUT
        if late:
            self.last_notes[f"timeout: batch over its {deadline_s:g} s deadline"] += len(late)

    def __del__(self) -> None:  # best effort at interpreter exit; close() is the contract
        try:
            if getattr(self, "_workers", None):
                self.close()
        except Exception:
            pass

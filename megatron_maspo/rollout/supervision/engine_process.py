"""The engine's own process: build the engine, load and verify weights, generate chunks, report progress.

    parent -> engine   ("load", version, n) then n x ("bucket", wire)    the weights, whole, with digests
                       ("generate", chunk, prompts, params)               one chunk of a round
                       ("stop",)
    engine -> parent   ("ready", pid, host)       built, holding no weights yet
                       ("progress", what)         a decode step done / a bucket loaded (the liveness signal)
                       ("loaded", version, verify_s)   weights applied and their digests checked
                       ("result", chunk, completions)
                       ("error", cause)           an exception; the process exits after sending it
                       ("verify_error", message)  held weights differ from the export: the job must stop

Each direction is a one-way pipe of its own, made fresh for every restart epoch, so a dead engine
leaves nothing behind that a new one could read. Messages are pickled here with the standard pickler
(tensors by value): ``Connection.send`` would hand CPU tensors over as shared-memory handles, which a
process that dies right after sending can leave unreadable.

The process leads a process group of its own (the engine and what it starts: vLLM's engine core and
workers), ignores SIGINT and SIGTERM (the supervisor decides when an engine stops) and ends its group
when its parent goes away, so a crashed trainer never leaves engines running.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

MESSAGE_PROTOCOL = pickle.HIGHEST_PROTOCOL


def send(conn: Any, msg: tuple) -> None:
    """Write one message (pickled by value)."""
    conn.send_bytes(pickle.dumps(msg, protocol=MESSAGE_PROTOCOL))


def recv(conn: Any) -> tuple:
    """Read one message (raises EOFError when the other end has closed)."""
    return pickle.loads(conn.recv_bytes())


@dataclass(frozen=True)
class EngineLaunch:
    """Everything one engine incarnation needs (picklable: it crosses into a spawned process)."""

    engine: int
    epoch: int
    rollout: Any
    """The ``rollout`` config section (``rollout.engines.build_engine`` reads it)."""
    model: Any
    """The ``model`` config section (engine dtype, routing replay)."""
    spec: Any
    """The architecture (``ArchSpec``)."""
    seed: int
    deterministic: bool = True
    gpus: tuple[int, ...] | None = None
    """The engine's node-local GPUs (``build_engine(gpus=...)``); None = the default device."""
    threads: int = 1
    """``torch.set_num_threads`` in the engine process."""
    progress_interval_s: float = 0.05
    """Least seconds between two progress reports (the first decode step always reports)."""
    fault: dict | None = None
    """Failure tests only. ``{"kind": "raise", "chunk": c, "step": s, "epochs": [0]}`` raises inside the
    generation of chunk ``c`` (absent: any chunk) after decode step ``s``; ``{"kind": "flip" | "stale",
    "epochs": [1]}`` corrupts one parameter after the first load (``Engine.inject_fault``), which the
    digest check must catch; ``{"kind": "kill" | "stop", "call": c, "step": s}`` sends the engine process
    SIGKILL / SIGSTOP at decode step ``s`` of its ``c``-th chunk. ``epochs``: the incarnations it applies
    to (absent: every one). Also read from ``MASPO_ENGINE_FAULT`` (:func:`fault_from_env`)."""


FAULT_ENV = "MASPO_ENGINE_FAULT"


def fault_from_env(engine: int, value: str | None = None) -> dict | None:
    """``MASPO_ENGINE_FAULT="engine=0,kind=kill,call=3,step=2"`` (end-to-end failure tests: the variable
    reaches the engine processes of a whole ``maspo train`` run) as an :attr:`EngineLaunch.fault` for
    ``engine``; None when unset or meant for another engine. It applies to the first incarnation only
    (``epochs=[0]``), so the restarted engine serves normally.

    Raises:
        ValueError: a malformed value, naming the variable.
    """
    value = os.environ.get(FAULT_ENV) if value is None else value
    if not value:
        return None
    try:
        fields = dict(kv.split("=", 1) for kv in value.split(","))
        fault = {"kind": fields.pop("kind"), "epochs": [0]}
        target = int(fields.pop("engine"))
        fault.update({k: int(v) for k, v in fields.items()})
    except (KeyError, ValueError) as e:
        raise ValueError(f"{FAULT_ENV}={value!r}: expected engine=E,kind=K[,call=C,step=S,chunk=N] ({e})") from None
    if fault["kind"] not in ("raise", "kill", "stop", "flip", "stale"):
        raise ValueError(f"{FAULT_ENV}={value!r}: kind must be raise, kill, stop, flip or stale")
    return fault if target == engine else None


def _fault_applies(launch: EngineLaunch, kind: str) -> bool:
    f = launch.fault
    return f is not None and f.get("kind") == kind and (f.get("epochs") is None or launch.epoch in f["epochs"])


def _exit_with_parent(poll_s: float = 0.5) -> None:
    """End this engine's process group as soon as the parent is gone (re-parented processes see another
    ppid): the engine and whatever it started (vLLM's engine core and workers)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        with contextlib.suppress(OSError):
            os.killpg(0, signal.SIGKILL)
        os._exit(3)

    threading.Thread(target=watch, name="engine-parent-watch", daemon=True).start()


class _Reporter:
    """Rate-limited progress messages from inside the decode loop (and the test fault hook)."""

    def __init__(self, out: Any, launch: EngineLaunch) -> None:
        self.out, self.launch = out, launch
        self.last = 0.0
        self.chunk: int | None = None
        self.steps = 0
        self.calls = 0
        """Chunks this incarnation has started (1-based while one runs)."""

    def __call__(self) -> None:
        self.steps += 1
        f = self.launch.fault
        if (_fault_applies(self.launch, "raise") and f.get("chunk", self.chunk) == self.chunk
                and self.steps >= f.get("step", 1)):
            raise RuntimeError(f"injected engine fault in chunk {self.chunk} at decode step {self.steps}")
        for kind, sig in (("kill", signal.SIGKILL), ("stop", signal.SIGSTOP)):
            if _fault_applies(self.launch, kind) and self.calls == f.get("call", 1) and self.steps == f.get("step", 1):
                send(self.out, ("progress", f"chunk {self.chunk} step {self.steps}"))  # mid-chunk, surely
                os.kill(os.getpid(), sig)  # a real signal: the supervisor sees exactly what an OOM kill is
        now = time.monotonic()
        if now - self.last >= self.launch.progress_interval_s:
            self.last = now
            send(self.out, ("progress", f"chunk {self.chunk} step {self.steps}"))


def _buckets(inbox: Any, out: Any, n: int) -> Iterator[Any]:
    """The ``n`` buckets of a load as they arrive, one progress report each."""
    from megatron_maspo.rollout.buckets import bucket_from_wire

    for _ in range(n):
        kind, wire = recv(inbox)
        assert kind == "bucket", kind
        yield bucket_from_wire(wire)
        send(out, ("progress", "bucket"))


def _serve(inbox: Any, out: Any, launch: EngineLaunch) -> None:
    import torch

    from megatron_maspo.errors import WeightVerifyError
    from megatron_maspo.rollout import engines

    torch.set_num_threads(launch.threads)
    if launch.fault is None:
        launch = replace(launch, fault=fault_from_env(launch.engine))
    engine = engines.build_engine(launch.rollout, launch.model, launch.spec, seed=launch.seed,
                                  deterministic=launch.deterministic, gpus=launch.gpus, colocated=False)
    engine.label = f"{engine.label} {launch.engine} (epoch {launch.epoch})"
    engine.defer_verify = False  # verified inside the load: no chunk is taken before the check passed
    for kind in ("flip", "stale"):
        if _fault_applies(launch, kind):
            engine.inject_fault(kind)
    send(out, ("ready", os.getpid(), socket.gethostname()))
    report = _Reporter(out, launch)
    version = 0
    while True:
        msg = recv(inbox)
        if msg[0] == "stop":
            return
        if msg[0] == "load":
            _, new_version, n = msg
            try:
                engine.load_buckets(_buckets(inbox, out, n))
            except WeightVerifyError as e:
                send(out, ("verify_error", str(e)))
                return
            version = new_version
            send(out, ("loaded", version, float(engine.verify_s)))
        elif msg[0] == "generate":
            _, chunk, prompts, params = msg
            report.chunk, report.steps, report.last, report.calls = chunk, 0, 0.0, report.calls + 1
            comps = _generate(engine, prompts, params, report, launch.rollout)
            for per in comps:
                for c in per:  # the version this supervisor sent, not the engine's own load count
                    c.policy_version, c.token_versions = version, None
            send(out, ("result", chunk, comps))
        else:
            raise ValueError(f"engine process: unknown message {msg[0]!r}")


def _generate(engine: Any, prompts: list[list[int]], params: Any, report: _Reporter, rollout: Any) -> Any:
    """One chunk, reporting progress from inside the decode loop where the engine allows it (``on_step``
    of the built-in engine) and per finished sequence otherwise (a blocking ``generate``)."""
    from megatron_maspo.rollout import engines

    if engines.traits(rollout).takes_weights_between_steps:
        return engine.generate(prompts, params, progress=lambda k: None, on_step=report)
    return engine.generate(prompts, params, progress=lambda k: report())


def process_name(engine: int) -> str:
    """The engine process's name as ``ps`` / ``/proc/<pid>/comm`` show it (at most 15 bytes on Linux)."""
    return f"maspo-engine{engine}"[:15]


def _set_process_name(name: str) -> None:
    """Name this process for operators (``ps``, ``top``) and failure tests (Linux ``prctl``; else a no-op)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME


def engine_main(inbox: Any, out: Any, launch: EngineLaunch) -> None:
    """Entry point of the engine process (``multiprocessing`` spawn target).

    First it leads a process group of its own: the failure domain is the engine *and* every process it
    starts (vLLM's engine core and its workers), which the supervisor ends with one ``killpg``, and which
    a signal the launcher sends to the job's group does not reach."""
    with contextlib.suppress(OSError):
        os.setpgrp()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _set_process_name(process_name(launch.engine))
    _exit_with_parent()
    try:
        _serve(inbox, out, launch)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(0)  # the supervisor closed the link: nothing to report to
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then the process ends
        last = traceback.extract_tb(e.__traceback__)[-1:]
        where = f" at {os.path.basename(last[0].filename)}:{last[0].lineno}" if last else ""
        with contextlib.suppress(Exception):
            send(out, ("error", f"raised {type(e).__name__}: {e}{where}"))
        os._exit(1)
    os._exit(0)


def with_epoch(launch: EngineLaunch, epoch: int) -> EngineLaunch:
    """The launch of the next incarnation."""
    return replace(launch, epoch=epoch)

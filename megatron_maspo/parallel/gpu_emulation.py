"""GPU semantics on the CPU bench (``MASPO_EMULATE_GPU=1``): streams, host reads, NCCL's ordering rule,
the backend each group would have on GPUs, and nodes.

The CPU bench has one device, no streams and no nodes, so a defect of the kind "right on gloo, hangs on
NCCL" cannot fail a test there. Under this emulation it does. What it models (facts from torch's
``ProcessGroupNCCL``; ``docs/gpu-emulation.md`` has the full list and what is not modelled):

- **Streams.** Each process is one GPU with one *default stream*, shared by every thread that never
  entered a side stream (:func:`side_stream`, which is ``torch.cuda.stream`` on CUDA). A collective on a
  group that would be NCCL on GPUs is an item on the calling thread's current stream: it starts only
  after the items before it on that stream, and the stream stays held until it completes (an
  ``async_op`` collective's ``.wait()`` returns at once, as on NCCL, and leaves the stream held).
  **Events** (:class:`Event`) stand for what a stream held when recorded; a stream made to wait for one
  (:meth:`Stream.wait_event`) is held by that wait until the event's items complete.
- **Host reads.** ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool/int/float(t)`` and a
  device-to-host ``copy_`` of a *device tensor* block the calling thread until its current stream has
  drained; so does any other op on a device tensor (a kernel queued behind the held stream: on CPU it
  runs at once, so it must wait to see the collective's result). Device tensors are parameters,
  buffers written by device collectives, buffers made with :func:`megatron_maspo.parallel.comm.device_empty`,
  and anything computed from one of those (tracked by a ``TorchFunctionMode`` in every thread).
- **Watchdog.** A thread blocked on a stream longer than ``MASPO_EMULATE_GPU_TIMEOUT_S`` (default 60)
  raises :class:`EmulatedGpuError` naming the stream, the item holding it and the thread that posted it,
  and the operation waiting behind it.
- **Order.** Two threads of one process posting collectives on the same group is an error unless the
  first handed the group over (:func:`hand_off`) or has ended: NCCL needs every rank to issue a
  communicator's collectives in the same order.
- **Backends.** Each group records the backend it gets on GPUs (``group_plan``'s rule); a device tensor
  on a group that would be gloo there is an error naming the group and its ranks.
- **Counts.** Every group a process makes is counted by the backend it gets on GPUs
  (:func:`groups_joined`), and every copy between host and device by direction (:func:`host_copies`;
  a device bridge's staging of a host tensor is one: :func:`to_device`).
- **Nodes.** ``MASPO_EMULATE_GPUS_PER_NODE=N`` (see :func:`node_env`) splits a one-host job into nodes
  of N GPUs: ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (what ``rollout/fleet.py::processes_per_node`` reads for
  the GPUs per node), ``GROUP_RANK`` and ``NNODES`` follow it.

Switched on only under ``parallel/`` (:func:`install`, called where the process joins its group); a
no-op on a machine with CUDA and when the variable is unset, so the product's hot path never sees it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_maspo.parallel.device import on_cuda

logger = logging.getLogger(__name__)

ENV, ENV_TIMEOUT, ENV_GPUS_PER_NODE = "MASPO_EMULATE_GPU", "MASPO_EMULATE_GPU_TIMEOUT_S", "MASPO_EMULATE_GPUS_PER_NODE"
_TAG = "_maspo_on_device"


class EmulatedGpuError(RuntimeError):
    """A GPU-only defect the emulation caught: a hang, two threads on one group, a device tensor on gloo."""


def requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``MASPO_EMULATE_GPU`` asks for the emulation (ignored on a machine with CUDA)."""
    return (env if env is not None else os.environ).get(ENV, "") not in ("", "0") and not on_cuda()


def timeout_s() -> float:
    """The watchdog's limit in seconds (``MASPO_EMULATE_GPU_TIMEOUT_S``, default 60)."""
    return float(os.environ.get(ENV_TIMEOUT, "60"))


def node_env(env: Mapping[str, str]) -> dict[str, str]:
    """``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK`` / ``NNODES`` of a rank when the job's one
    host is split into nodes of ``MASPO_EMULATE_GPUS_PER_NODE`` GPUs (ranks node-major, as torchrun and
    srun place them); ``{}`` when emulation or the split is off."""
    per = env.get(ENV_GPUS_PER_NODE)
    if not per or not requested(env) or "RANK" not in env or "WORLD_SIZE" not in env:
        return {}
    n, rank, world = int(per), int(env["RANK"]), int(env["WORLD_SIZE"])
    if n < 1:
        raise ValueError(f"{ENV_GPUS_PER_NODE}={per}: must be >= 1")
    return {"LOCAL_RANK": str(rank % n), "LOCAL_WORLD_SIZE": str(min(n, world)), "GROUP_RANK": str(rank // n),
            "NNODES": str(-(-world // n))}


# ------------------------------------------------------------------------------------------- streams
class _Item:
    __slots__ = ("name", "thread", "done", "error")

    def __init__(self, name: str) -> None:
        self.name, self.thread, self.done, self.error = name, threading.current_thread().name, False, None


class Stream:
    """An emulated CUDA stream: a FIFO of in-flight collectives. Thread-safe."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._items: list[_Item] = []
        self._cond = threading.Condition()

    def post(self, name: str) -> _Item:
        """Queue the operation ``name`` from the calling thread; it holds the stream until :meth:`finish`."""
        item = _Item(name)
        with self._cond:
            self._items.append(item)
        return item

    def finish(self, item: _Item, error: BaseException | None = None) -> None:
        """Mark ``item`` complete (``error``: how it failed) and wake the threads waiting on the stream."""
        with self._cond:
            item.done, item.error = True, error
            while self._items and self._items[0].done:
                self._items.pop(0)
            self._cond.notify_all()

    def busy(self) -> bool:
        """Whether an item is still queued (a device op of the calling thread must wait)."""
        return bool(self._items)

    def _wait(self, pending, waiter: str) -> None:
        limit = timeout_s()
        deadline = time.monotonic() + limit
        with self._cond:
            while (head := pending()) is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EmulatedGpuError(
                        f"GPU emulation: {self.name} blocked for {limit:.0f} s ({ENV_TIMEOUT}): held by "
                        f"{head.name} posted by thread {head.thread!r}; waiting behind it: {waiter} in thread "
                        f"{threading.current_thread().name!r}. On GPUs this hangs until the NCCL timeout.")
                self._cond.wait(min(left, 0.2))

    def wait_turn(self, item: _Item, waiter: str) -> None:
        """Block until every item posted before ``item`` has completed."""
        def pending():
            for it in self._items:
                if it is item:
                    return None
                if not it.done:
                    return it
            return None
        self._wait(pending, waiter)

    def synchronize(self, waiter: str = "stream.synchronize()") -> None:
        """Block until every item on the stream has completed (``torch.cuda.Stream.synchronize``)."""
        self._wait(lambda: next((it for it in self._items if not it.done), None), waiter)

    def record_event(self) -> Event:
        """An event of everything queued on the stream so far (``torch.cuda.Event.record(stream)``)."""
        with self._cond:
            return Event(self, [it for it in self._items if not it.done])

    def wait_event(self, event: Event) -> None:
        """Make the stream's later work wait for ``event`` (``torch.cuda.Stream.wait_event``): an item that
        holds this stream until the event's items have completed; the host goes on."""
        if event.query():
            return
        item = self.post(f"a wait for an event of {event.stream.name}")

        def complete() -> None:
            err = None
            try:
                event.synchronize(f"{self.name}'s wait for the event")
            except BaseException as e:  # noqa: BLE001 (the watchdog of a waiter behind it reports the hang)
                err = e
            self.finish(item, err)

        threading.Thread(target=complete, name="emulated-wait-event", daemon=True).start()


class Event:
    """An emulated CUDA event: the items its stream held when it was recorded (:meth:`Stream.record_event`)."""

    def __init__(self, stream: Stream, items: list[_Item]) -> None:
        self.stream, self._items = stream, items

    def query(self) -> bool:
        """Whether all of it has completed (``torch.cuda.Event.query``)."""
        return all(it.done for it in self._items)

    def synchronize(self, waiter: str = "event.synchronize()") -> None:
        """Block the host until it has completed (``torch.cuda.Event.synchronize``); the watchdog applies."""
        self.stream._wait(lambda: next((it for it in self._items if not it.done), None), waiter)


class _State:
    def __init__(self, label: str) -> None:
        self.default = Stream(f"the default stream of {label}")
        self.tls = threading.local()
        self.lock = threading.Lock()
        self.groups: dict[int, tuple[str, str, tuple[int, ...]]] = {}  # id(pg) -> (gpu backend, name, ranks)
        self.last_poster: dict[int, tuple[threading.Thread, str]] = {}
        self.host_copy_bytes = 0
        self.host_copies: dict[str, int] = {}  # "h2d" / "d2h" -> copies
        self.joined: list[tuple[str, str]] = []  # (gpu backend, name) of every group made, in order


_STATE: _State | None = None


def active() -> bool:
    """Whether this process runs under the emulation."""
    return _STATE is not None


def current_stream() -> Stream:
    """The calling thread's stream: its side stream inside :func:`stream`, else the process's default one."""
    assert _STATE is not None
    return getattr(_STATE.tls, "stream", None) or _STATE.default


def _inside() -> bool:
    return _STATE is not None and getattr(_STATE.tls, "inside", False)


@contextlib.contextmanager
def _raw() -> Iterator[None]:
    """The emulation's own torch calls (inside a collective) are not device work of the caller."""
    assert _STATE is not None
    prev = getattr(_STATE.tls, "inside", False)
    _STATE.tls.inside = True
    try:
        yield
    finally:
        _STATE.tls.inside = prev


@contextlib.contextmanager
def stream(s: Stream) -> Iterator[Stream]:
    """Make ``s`` the calling thread's current stream for the block (``torch.cuda.stream``)."""
    assert _STATE is not None
    prev = getattr(_STATE.tls, "stream", None)
    _STATE.tls.stream = s
    try:
        yield s
    finally:
        _STATE.tls.stream = prev


# -------------------------------------------------------------------------------------- device tensors
def mark_device(t: torch.Tensor) -> torch.Tensor:
    """Record ``t`` as living on the emulated GPU; returns ``t``."""
    if isinstance(t, torch.Tensor):
        setattr(t, _TAG, True)
    return t


def is_device(t: Any) -> bool:
    """Whether ``t`` is a tensor on the emulated GPU (a parameter, or marked / computed from one)."""
    return isinstance(t, torch.Tensor) and (isinstance(t, torch.nn.Parameter) or getattr(t, _TAG, False))


def _any_device(args: tuple, kwargs: Mapping[str, Any]) -> bool:
    for a in (*args, *kwargs.values()):
        if is_device(a):
            return True
        if isinstance(a, (list, tuple)) and any(is_device(x) for x in a):
            return True
    return False


def _tag(out: Any) -> None:
    if isinstance(out, torch.Tensor):
        setattr(out, _TAG, True)
    elif isinstance(out, (list, tuple)):
        for o in out:
            if isinstance(o, torch.Tensor):
                setattr(o, _TAG, True)


def host_copy_bytes() -> int:
    """Bytes copied between host and (emulated) device by this process so far."""
    return _STATE.host_copy_bytes if _STATE is not None else 0


def host_copies() -> dict[str, int]:
    """Copies between host and (emulated) device so far, by direction: ``{"h2d": n, "d2h": m}``."""
    return dict(_STATE.host_copies) if _STATE is not None else {}


def count_copy(nbytes: int, direction: str = "d2h") -> None:
    """Count one host <-> device copy of ``nbytes`` (``direction``: ``"h2d"`` or ``"d2h"``)."""
    if _STATE is not None:
        with _STATE.lock:
            _STATE.host_copy_bytes += int(nbytes)
            _STATE.host_copies[direction] = _STATE.host_copies.get(direction, 0) + 1


def to_device(t: torch.Tensor) -> torch.Tensor:
    """A device copy of the host tensor ``t`` (``t.to(cuda)``: counted as one host-to-device copy)."""
    count_copy(_nbytes(t), "h2d")
    with _raw():
        return mark_device(t.detach().clone().contiguous())


def device_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous device tensor shaped like ``t`` (``torch.empty`` on the GPU: no copy)."""
    with _raw():
        return mark_device(torch.empty(t.shape, dtype=t.dtype))


_T = torch.Tensor
_SCALAR_READS = {_T.item, _T.__bool__, _T.__int__, _T.__float__, _T.__index__}
_BULK_READS = {_T.tolist, _T.numpy, _T.cpu, _T.__array__}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Mode(TorchFunctionMode):
    """Host reads of device tensors wait for the thread's stream; device results are tagged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _STATE is None or _inside():
            return func(*args, **kwargs)
        if func in _SCALAR_READS or func in _BULK_READS:
            if args and is_device(args[0]):
                current_stream().synchronize(f"{func.__name__}() of a device tensor (a host read)")
                count_copy(_nbytes(args[0]) if func in _BULK_READS else args[0].element_size())
            return func(*args, **kwargs)
        dev = _any_device(args, kwargs)
        if dev and current_stream().busy():  # a kernel queued behind the held stream
            current_stream().synchronize(f"{getattr(func, '__name__', func)} on a device tensor")
        if func is _T.copy_ and len(args) >= 2 and is_device(args[0]) != is_device(args[1]):
            count_copy(_nbytes(args[1]), "h2d" if is_device(args[0]) else "d2h")  # the destination keeps its place
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if dev:
            _tag(out)
        return out


# -------------------------------------------------------------------------------------------- groups
def record_group(pg: Any, gpu_backend: str, name: str, ranks: tuple[int, ...]) -> None:
    """Remember the backend ``pg`` gets on GPUs (``"nccl"``: a device group, ``"gloo"``: host only) and
    count it among this process's groups (:func:`groups_joined`)."""
    if _STATE is not None and pg is not None:
        _STATE.groups[id(pg)] = (gpu_backend, name, tuple(ranks))
        with _STATE.lock:
            _STATE.joined.append((gpu_backend, name))


def groups_joined() -> dict[str, int]:
    """Groups this process has made so far, by the backend each gets on GPUs: ``{"nccl": n, "gloo": m}``."""
    out: dict[str, int] = {}
    for backend, _ in (_STATE.joined if _STATE is not None else ()):
        out[backend] = out.get(backend, 0) + 1
    return out


def release(pg: Any) -> None:
    """The calling thread is done with ``pg`` (its set-up traffic): another thread may post on it next."""
    if _STATE is not None:
        with _STATE.lock:
            _STATE.last_poster.pop(_key(pg), None)


def _describe(pg: Any) -> tuple[str, str, tuple[int, ...]]:
    assert _STATE is not None
    if pg is None or pg is dist.GroupMember.WORLD:
        pg = dist.distributed_c10d._get_default_group()
    if id(pg) in _STATE.groups:
        return _STATE.groups[id(pg)]
    ranks = tuple(dist.get_process_group_ranks(pg))
    backend = _STATE.groups.get(id(dist.distributed_c10d._get_default_group()), ("nccl",))[0]
    return backend, f"group {list(ranks)}", ranks


def hand_off() -> None:
    """The calling thread is done posting collectives on every group it used: another thread may take
    them over (the order across ranks is then this thread's, then the next one's)."""
    if _STATE is None:
        return
    me = threading.current_thread()
    with _STATE.lock:
        for key in [k for k, (t, _) in _STATE.last_poster.items() if t is me]:
            del _STATE.last_poster[key]


def _check_order(key: int, name: str, op: str) -> None:
    assert _STATE is not None
    me = threading.current_thread()
    with _STATE.lock:
        last = _STATE.last_poster.get(key)
        if last is not None and last[0] is not me and last[0].is_alive():
            raise EmulatedGpuError(
                f"GPU emulation: threads {last[0].name!r} ({last[1]}) and {me.name!r} ({op}) both post "
                f"collectives on {name}; NCCL needs every rank to issue a group's collectives in one order, "
                "which two threads of a process do not give. Keep them on one thread, or hand the group "
                "over (comm.hand_off() in the thread that is done with it).")
        _STATE.last_poster[key] = (me, op)


def host_call(pg: Any, op: str, run, tensors: tuple = ()) -> Any:
    """``run()`` checked for the group's backend and the posting order, not queued on a stream."""
    assert _STATE is not None
    backend, name, ranks = _describe(pg)
    _check_backend(backend, name, ranks, op, tensors)
    if backend == "nccl":
        _check_order(_key(pg), name, op)
        for t in tensors:
            mark_device(t)
    with _raw():
        return run()


def _key(pg: Any) -> int:
    return id(pg) if pg is not None else id(dist.distributed_c10d._get_default_group())


def _check_backend(backend: str, name: str, ranks: tuple[int, ...], op: str, tensors: tuple) -> None:
    if backend != "nccl" and any(is_device(t) for t in tensors):
        raise EmulatedGpuError(f"GPU emulation: {op} carries a device tensor on {name} (ranks "
                               f"{list(ranks)}), which is {backend} on GPUs: a device group must be NCCL")


def device_collective(pg: Any, op: str, run, tensors: tuple = (), *, async_op: bool = False) -> Any:
    """Run ``run()`` (the gloo call) as the collective ``op`` on ``pg`` would run on GPUs.

    A device group: an item on the calling thread's stream, started after the items before it and
    holding the stream until done (``async_op``: ``run`` returns a work whose completion releases the
    stream in the background; the caller gets a work whose ``wait()`` returns at once, as NCCL's
    does for the host). A host group: a plain blocking call; a device tensor in ``tensors`` is an error.
    """
    assert _STATE is not None
    backend, name, ranks = _describe(pg)
    _check_backend(backend, name, ranks, op, tensors)
    if backend != "nccl":
        with _raw():
            return run()
    _check_order(_key(pg), name, op)
    s = current_stream()
    item = s.post(f"{op} on {name}")
    s.wait_turn(item, f"{op} on {name}")
    for t in tensors:
        mark_device(t)
    if not async_op:
        try:
            with _raw():
                return run()
        finally:
            s.finish(item)
    with _raw():
        work = run()

    def complete() -> None:
        err = None
        try:
            work.wait()
        except BaseException as e:  # noqa: BLE001 (a later host read reports it)
            err = e
        s.finish(item, err)

    threading.Thread(target=complete, name=f"emulated-nccl {op}", daemon=True).start()
    return _StreamWork(item)


class _StreamWork:
    """What ``wait()`` on an NCCL work is for the host: the stream waits, the host goes on."""

    def __init__(self, item: _Item) -> None:
        self._item = item

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return self._item.done


_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "reduce_scatter", "all_to_all_single", "all_to_all", "reduce", "gather", "scatter", "send",
                "recv", "barrier", "broadcast_object_list", "all_gather_object", "gather_object",
                "scatter_object_list")
# Not wrapped: isend / irecv (``P2POp`` checks them by identity) and batch_isend_irecv: pipeline p2p runs
# as on gloo, unchecked.


def _wrap(fn_name: str, orig):
    sig = inspect.signature(orig)

    def wrapper(*args, **kwargs):
        if _STATE is None or _inside():
            return orig(*args, **kwargs)
        bound = sig.bind_partial(*args, **kwargs).arguments
        pg = bound.get("group")
        tensors = tuple(x for v in bound.values() for x in (v if isinstance(v, (list, tuple)) else (v,))
                        if isinstance(x, torch.Tensor))
        if bool(bound.get("async_op")):
            # Megatron's overlapped and p2p work: its results are read by C++ autograd, which the mode
            # cannot make wait, so it is checked (backend, order) but not queued on a stream.
            return host_call(pg, f"torch.distributed.{fn_name}", lambda: orig(*args, **kwargs), tensors)
        return device_collective(pg, f"torch.distributed.{fn_name}", lambda: orig(*args, **kwargs), tensors)

    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


def _wrap_new_group(orig):
    def new_group(*args, **kwargs):
        pg = orig(*args, **kwargs)
        if _STATE is not None and pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER:
            backend = kwargs.get("backend") if "backend" in kwargs else (args[2] if len(args) > 2 else None)
            ranks = tuple(dist.get_process_group_ranks(pg))
            gpu = "gloo" if backend is not None and str(backend).lower() == "gloo" else _describe(None)[0]
            record_group(pg, gpu, f"group {list(ranks)}" + (" (gloo: host only)" if gpu == "gloo" else ""),
                         ranks)
        return pg

    new_group.__wrapped__ = orig  # type: ignore[attr-defined]
    return new_group


def _push_mode_in_new_threads() -> None:
    orig = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def bootstrap(self):
        if _STATE is not None:
            _Mode().__enter__()  # the mode stack is per thread: every thread of the process gets it
        return orig(self)

    threading.Thread._bootstrap_inner = bootstrap  # type: ignore[attr-defined]


def install(label: str = "cuda:0") -> bool:
    """Switch the emulation on for this process if ``MASPO_EMULATE_GPU`` asks for it (idempotent);
    True when it is on. Call before the process group exists and before any thread is started."""
    global _STATE
    if _STATE is not None:
        return True
    if not requested():
        return False
    _STATE = _State(label)
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _wrap(name, getattr(dist, name)))
    dist.new_group = _wrap_new_group(dist.new_group)
    _Mode().__enter__()
    _push_mode_in_new_threads()
    logger.info("GPU emulation on (%s=1): streams, host reads, group order and backends are checked", ENV)
    return True

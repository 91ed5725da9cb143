"""The one module that calls ``torch.distributed`` collectives: every tensor goes in on its group's device.

An NCCL group accepts CUDA tensors only: a CPU control tensor (a flag, a count, a receive buffer made
with ``torch.empty``) handed to it raises ``No backend type associated with device type cpu`` on the
first GPU step. Callers here build tensors where it is natural for them and this module stages them:

    buf = t                    if the group has a backend for t's device type (no copy)
        = t.to(comm_device(g)) otherwise, and the result is copied back into t afterwards

so ``all_reduce(torch.tensor([flag]), op=MAX)`` works unchanged on gloo (CPU), NCCL (staged through
the current CUDA device) and device-mapped groups (``"cpu:gloo,cuda:nccl"``).

Default group design (``init_default_group``): **NCCL only on GPU, gloo on CPU**; control tensors move
to the current CUDA device here. We do not initialise ``"cpu:gloo,cuda:nccl"``:
- Megatron creates every subgroup (TP, PP, DP, EP, embedding, ...) with the default backend; a mixed
  default would give each of them a gloo communicator as well (TCP pairs per group, set up at start,
  one more transport that can time out), for a handful of scalars per step;
- those scalars are read with ``.item()`` right after the collective anyway, so running them on the
  GPU costs one small kernel and the same host sync; object collectives (``broadcast_object``) are
  staged by torch through the current device, which ``bind_local_device`` sets before the group exists;
- one backend per group means one failure path (see :mod:`megatron_maspo.parallel.failure`).
Groups someone creates with another backend (Megatron's explicit gloo groups) work too: the device is
read from the group, never assumed.

The groups between the pools of a disaggregated job (``Bridge``, built in one pass by ``build_bridges``)
live in ``parallel/bridge.py``.

Every function but ``send``/``recv`` is a no-op (returns its input) without a process group, so
single-process code and unit tests call them unconditionally. Tensor collectives run on any
initialised group, one rank included: a one-GPU NCCL world exercises the same staging as a cluster.
Object collectives and barriers return at once on a one-rank group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron_maspo.parallel import gpu_emulation as _emu
from megatron_maspo.parallel import group_plan
from megatron_maspo.parallel.device import on_cuda

logger = logging.getLogger(__name__)

ReduceOp = dist.ReduceOp

_bound: torch.device | None = None
"""This process's GPU (:func:`bind_local_device`): collectives stage there from any thread."""


def initialized() -> bool:
    """True when the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def active(group: Any = None) -> bool:
    """True when a process group exists and ``group`` (default: the world) has more than one rank."""
    return initialized() and dist.get_world_size(group) > 1


def default_backend() -> str:
    """``"nccl"`` when CUDA is present, else ``"gloo"``.

    Never a function of the group's size: a pool larger than one node's GPUs is still NCCL (every rank
    has a GPU of its own on its node), and Megatron's TP/DP/PP/EP groups inherit this backend. Two ranks
    on one GPU are refused by :func:`bind_local_device` in one line, not served by gloo.
    """
    return "nccl" if on_cuda() else "gloo"


def start_emulation(label: str | None = None) -> bool:
    """Switch the GPU-semantics emulation on when ``MASPO_EMULATE_GPU`` asks for it (CPU only; idempotent).
    Called where a process joins its group, before any thread starts; True when it is on."""
    return _emu.install(label or f"cuda:{os.environ.get('LOCAL_RANK', '0')} of rank {os.environ.get('RANK', '0')}")


def emulated_node_env() -> dict[str, str]:
    """``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK`` / ``NNODES`` of this rank when
    ``MASPO_EMULATE_GPUS_PER_NODE`` splits a one-host job into nodes (``{}`` otherwise): the caller puts
    them into ``os.environ`` before anything reads them."""
    return _emu.node_env(os.environ)


def emulates_nodes(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``MASPO_EMULATE_GPUS_PER_NODE`` splits this one host into emulated nodes (their "addresses"
    are then all loopback)."""
    return bool(_emu.node_env(dict(os.environ if env is None else env)))


def host_copy_bytes() -> int | None:
    """Bytes this process has copied between host and device so far, as the emulation counts them
    (None when it is off: a real GPU run has no such counter)."""
    return _emu.host_copy_bytes() if _emu.active() else None


def host_copy_count() -> dict[str, int] | None:
    """Copies between host and device so far, by direction (``{"h2d": n, "d2h": m}``), as the emulation
    counts them (None when it is off)."""
    return _emu.host_copies() if _emu.active() else None


def emulated_groups() -> dict[str, int] | None:
    """Process groups this process has made, by the backend each gets on GPUs (``{"nccl": n, "gloo": m}``),
    as the emulation counts them (None when it is off)."""
    return _emu.groups_joined() if _emu.active() else None


def synchronize_stream() -> None:
    """Wait for the calling thread's current stream (CUDA, or the emulated one; no-op on the CPU)."""
    if on_cuda():
        torch.cuda.current_stream(local_device()).synchronize()
    elif _emu.active():
        _emu.current_stream().synchronize("comm.synchronize_stream()")


def device_empty(n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised ``[n]`` buffer on this process's GPU (the emulated one under the emulation)."""
    if on_cuda():
        return torch.empty(n, dtype=dtype, device=local_device())
    t = torch.empty(n, dtype=dtype)
    return _emu.mark_device(t) if _emu.active() else t


class _HostStream:
    """What :func:`side_stream` yields without a GPU: nothing to wait for."""

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def side_stream(name: str = "side stream") -> Iterator[Any]:
    """Run the block on a CUDA stream of its own (the emulated one under the emulation); yields the
    stream, whose ``synchronize()`` the block calls before its results are used elsewhere.

    A thread that posts collectives which may stay pending (a receive waiting for a sender) must not do
    so on the default stream: every thread of the process shares that one, and any host read on it
    (``.item()``, ``.cpu()``) would then wait for the pending collective.
    """
    if on_cuda():
        s = torch.cuda.Stream(device=local_device())
        with torch.cuda.stream(s):
            yield s
    elif _emu.active():
        with _emu.stream(_emu.Stream(f"the {name} of thread {threading.current_thread().name!r}")) as s:
            yield s
    else:
        yield _HostStream()


def record_for_default_stream(t: torch.Tensor) -> None:
    """``t`` was written on a side stream and is read on the default one from now on: tell the CUDA
    caching allocator (no-op off CUDA)."""
    if t.is_cuda:
        t.record_stream(torch.cuda.default_stream(t.device))


def hand_off() -> None:
    """The calling thread posts no more collectives on the groups it used until another thread has had
    its turn (NCCL's order across ranks is then the hand-off's). A no-op outside the emulation, which
    otherwise reports two threads posting on one group."""
    _emu.hand_off()


def bind_local_device(local_rank: int | None = None) -> torch.device:
    """Make GPU ``LOCAL_RANK`` this process's current CUDA device (CPU: no-op); returns the device.

    Must run before the process group, the model or any CUDA tensor exists: without it every rank of
    a node allocates on GPU 0 and NCCL sees duplicate devices.
    """
    if not on_cuda():
        return torch.device("cpu")
    idx = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    n = torch.cuda.device_count()
    if not 0 <= idx < n:
        raise RuntimeError(f"LOCAL_RANK={idx} but this node has {n} visible GPU(s); launch at most "
                           f"{n} processes per node (CUDA_VISIBLE_DEVICES)")
    global _bound
    torch.cuda.set_device(idx)
    _bound = torch.device("cuda", idx)
    return _bound


def local_device() -> torch.device | None:
    """The CUDA device collectives of this process use: the bound one (:func:`bind_local_device`), else the
    calling thread's current one; None without CUDA. Read explicitly, never from the thread: a helper
    thread (the weight sync's prefetch) starts on device 0."""
    if not on_cuda():
        return None
    return _bound if _bound is not None else torch.device("cuda", torch.cuda.current_device())


@contextlib.contextmanager
def _on_local_device(device: torch.device | None = None) -> Iterator[None]:
    """torch stages object collectives on ``torch.cuda.current_device()``: make that ``device`` (a CUDA
    device; default the bound one) for the block."""
    dev = device if device is not None and device.type == "cuda" else local_device()
    if dev is None:
        yield
        return
    with torch.cuda.device(dev):
        yield


def init_default_group(timeout_s: float = 1800.0, *, backend: str | None = None) -> tuple[int, int]:
    """Bind the local GPU, then join the default group from the torchrun environment (``env://``).

    Returns (rank, world_size). On NCCL the group is bound to the local device (``device_id``) so
    its communicator is created eagerly and barriers know their device.
    """
    import datetime

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or default_backend()
    kw: dict[str, Any] = {}
    if backend == "nccl":
        kw["device_id"] = bind_local_device()
    start_emulation()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    _record_default_group("world")
    return dist.get_rank(), dist.get_world_size()


def _record_default_group(name: str) -> None:
    """Under the emulation: the default group is NCCL on GPUs (Megatron's groups inherit it)."""
    if _emu.active():
        pg = dist.distributed_c10d._get_default_group()
        backend = group_plan.gpu_backend(carries_device=True, members_share_a_gpu=False)
        _emu.record_group(pg, backend, f"the {name} default group", tuple(dist.get_process_group_ranks(pg)))


def _device_types(group: Any) -> set[str]:
    """Device types ``group`` has a backend for, e.g. {"cuda"} for NCCL, {"cpu", "cuda"} for gloo."""
    config = str(dist.get_backend_config(group))  # "cuda:nccl" / "cpu:gloo,cuda:gloo" / "nccl"
    types = {part.split(":")[0] for part in config.split(",") if ":" in part}
    if types:
        return types
    return {"cuda"} if config == "nccl" else {"cpu"}


def comm_device(group: Any = None) -> torch.device:
    """Where tensors for ``group`` should live: CPU if it has a CPU backend, else the current accelerator.

    ``group=None`` is the default (world) group.
    """
    types = _device_types(group)
    if "cpu" in types:
        return torch.device("cpu")
    dev_type = "cuda" if "cuda" in types else sorted(types)[0]
    if dev_type == "cuda" and on_cuda():
        return local_device()  # type: ignore[return-value]
    return torch.device(dev_type)


def _staged(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``t`` itself if ``group`` takes it as is (right device type, contiguous), else a staged copy."""
    if t.device.type in _device_types(group) and t.is_contiguous():
        return t
    return t.to(comm_device(group)).contiguous()


def _write_back(t: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    if buf is not t:
        t.copy_(buf)
    return t


# --------------------------------------------------------------------------- tensor collectives
def all_reduce(t: torch.Tensor, op: dist.ReduceOp = ReduceOp.SUM, group: Any = None) -> torch.Tensor:
    """In-place all-reduce of ``t`` (any shape, any device) over ``group``; returns ``t``."""
    if not initialized():
        return t
    buf = _staged(t, group)
    dist.all_reduce(buf, op=op, group=group)
    return _write_back(t, buf)


def broadcast(t: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
    """In-place broadcast of ``t`` from global rank ``src``; on receivers ``t`` is the preallocated
    buffer (same shape and dtype), e.g. a CPU ``torch.empty``. Returns ``t``."""
    if not initialized():
        return t
    buf = _staged(t, group)
    dist.broadcast(buf, src=src, group=group)
    return _write_back(t, buf)


def all_gather(t: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape and dtype on all ranks), in group-rank order, on ``t``'s device."""
    if not initialized():
        return [t]
    buf = _staged(t, group)
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, buf, group=group)
    return [p if p.device == t.device else p.to(t.device) for p in parts]


def reduce_scatter(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum ``t`` ``[world·n, ...]`` over ``group`` and return this rank's block ``[n, ...]``.

    Block ``k`` (rows ``[k·n, (k+1)·n)``) goes to group rank ``k``. gloo has no reduce-scatter, so
    a CPU group all-reduces and slices (the same sums; more bytes, which CPU runs do not mind).
    """
    if not initialized():
        return t
    world = dist.get_world_size(group)
    if t.shape[0] % world:
        raise ValueError(f"reduce_scatter: leading dim {t.shape[0]} is not a multiple of {world}")
    n = t.shape[0] // world
    rank = dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()
    buf = _staged(t, group)
    if "cpu" in _device_types(group):
        buf = buf.clone() if buf is t else buf
        dist.all_reduce(buf, group=group)
        out = buf[rank * n:(rank + 1) * n]
    else:
        out = torch.empty((n, *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
        dist.reduce_scatter_tensor(out, buf, group=group)
    return out if out.device == t.device else out.to(t.device)


def send(t: torch.Tensor, dst: int, group: Any = None) -> None:
    """Blocking point-to-point send of ``t`` to global rank ``dst``."""
    dist.send(_staged(t, group), dst=dst, group=group)


def recv(t: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
    """Blocking receive from global rank ``src`` into the preallocated ``t``; returns ``t``."""
    buf = _staged(t, group)
    dist.recv(buf, src=src, group=group)
    return _write_back(t, buf)


def any_true(flag: bool, group: Any = None) -> bool:
    """Collective OR: True on every rank of ``group`` if ``flag`` is True on any of them."""
    return bool(all_reduce(torch.tensor([1.0 if flag else 0.0]), op=ReduceOp.MAX, group=group).item() > 0)


# --------------------------------------------------------------------------- object collectives
def broadcast_object(obj: Any, src: int = 0, group: Any = None, device: torch.device | None = None) -> Any:
    """A picklable object from global rank ``src`` to every rank of ``group``.

    torch pickles into a byte tensor on the group's object device (the current CUDA device for
    NCCL: ``device`` if given, else the bound one, from any thread).
    """
    if not active(group):
        return obj
    box = [obj]
    with _on_local_device(device):  # torch stages on the current device: the bound one, from any thread
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, group: Any = None, device: torch.device | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order (staged on ``device`` for NCCL: a CUDA device,
    default the bound one, whatever thread calls)."""
    if not active(group):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    with _on_local_device(device):  # the manifest gather runs in the prefetch thread (issue 29, defect 4)
        dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Any = None) -> None:
    """Wait for every rank of ``group`` (no-op without a multi-rank world)."""
    if active(group):
        dist.barrier(group=group)


# --------------------------------------------------------------------------- groups between pools
def job_store(timeout_s: float = 1800.0) -> Any:
    """The job's rendezvous store (torchrun's agent store, or rank 0's TCPStore under srun): what a
    pool's default group and every :class:`Bridge` are built on, each under its own key prefix."""
    import datetime

    store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    return store


def init_pool_group(store: Any, pool: str, rank: int, world: int, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Make this pool's ranks the default group (``rank`` of ``world`` inside the pool), so Megatron and
    every collective above see only their own pool (disaggregated placement: ``rollout/pools.py``)."""
    import datetime

    backend = default_backend()  # never by the pool's size (a 16-rank pool on 8-GPU nodes is NCCL)
    kw: dict[str, Any] = {"device_id": bind_local_device()} if backend == "nccl" else {}
    start_emulation()
    dist.init_process_group(backend, store=dist.PrefixStore(f"maspo/pool/{pool}", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    _record_default_group(f"{pool} pool's")
    return dist.get_rank(), dist.get_world_size()


def gpu_identity() -> str:
    """Which physical GPU this process computes on: host and device UUID (CUDA), host, emulated node and
    local rank (the emulation), or host and pid (plain CPU: every process its own "device")."""
    import socket

    host = socket.gethostname()
    if on_cuda():
        return f"{host}/{torch.cuda.get_device_properties(local_device()).uuid}"
    if _emu.active():
        return f"{host}/node{os.environ.get('GROUP_RANK', '0')}/gpu{os.environ.get('LOCAL_RANK', '0')}"
    return f"{host}/pid{os.getpid()}"


def pin_host(t: torch.Tensor) -> Any:
    """Page-lock the host memory under ``t`` (its whole storage) so copies to and from a GPU are DMA at full
    speed, not staged through pageable memory: ``cudaHostRegister`` through ``torch.cuda.cudart()``.

    For memory torch did not allocate pinned, e.g. shared-memory buffers (``/dev/shm``) a receiver lands
    buckets in for processes that map them. Returns the callable that unregisters it, to call before the
    memory is freed; None where nothing was registered (no CUDA, a GPU tensor, an empty or already pinned
    one). A refusal by the driver (a locked-memory limit) is logged and the memory stays pageable.
    """
    if not on_cuda() or t.is_cuda or t.untyped_storage().nbytes() == 0 or t.is_pinned():
        return None
    storage = t.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    rt = torch.cuda.cudart()
    err = rt.cudaHostRegister(ptr, nbytes, 0)
    if err != rt.cudaError.success:
        logger.warning("cudaHostRegister of %d bytes failed (%s): copies into it stay pageable", nbytes,
                       rt.cudaGetErrorString(err))
        return None
    return lambda: rt.cudaHostUnregister(ptr)


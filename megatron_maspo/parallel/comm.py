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

Every function but ``send``/``recv`` is a no-op (returns its input) without a process group, so
single-process code and unit tests call them unconditionally. Tensor collectives run on any
initialised group, one rank included: a one-GPU NCCL world exercises the same staging as a cluster.
Object collectives and barriers return at once on a one-rank group.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_maspo.parallel.device import on_cuda

ReduceOp = dist.ReduceOp

_bound: torch.device | None = None
"""This process's GPU (:func:`bind_local_device`): collectives stage there from any thread."""


def initialized() -> bool:
    """True when the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def active(group: Any = None) -> bool:
    """True when a process group exists and ``group`` (default: the world) has more than one rank."""
    return initialized() and dist.get_world_size(group) > 1


def default_backend(world_size: int | None = None) -> str:
    """``"nccl"`` when CUDA is present (and has a GPU per local rank), else ``"gloo"``."""
    if not on_cuda():
        return "gloo"
    if world_size is not None and world_size > torch.cuda.device_count():
        return "gloo"  # NCCL refuses two ranks on one GPU; gloo ranks may share one
    return "nccl"


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
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return dist.get_rank(), dist.get_world_size()


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

    backend = default_backend(world)
    kw: dict[str, Any] = {"device_id": bind_local_device()} if backend == "nccl" else {}
    dist.init_process_group(backend, store=dist.PrefixStore(f"maspo/pool/{pool}", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return dist.get_rank(), dist.get_world_size()


class Bridge:
    """A process group across pools, outside torch's group registry (the default group of each pool
    holds only that pool's ranks, so ``new_group`` cannot span them).

    Built straight on the job store under ``maspo/bridge/<name>``; ``ranks`` are global ranks and index 0
    is the usual root. gloo always works (CPU tensors); ``backend="nccl"`` puts tensors on this process's
    GPU (weights between GPU pools). Every member must call each operation in the same order, and one
    bridge is used by one thread only (the engine side runs its weight receiver in a thread of its own,
    on a bridge of its own).
    """

    def __init__(self, store: Any, name: str, ranks: tuple[int, ...], rank: int, *, backend: str = "gloo",
                 timeout_s: float = 1800.0) -> None:
        import datetime

        if rank not in ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"bridge {name!r}: rank {rank} not among distinct ranks {ranks}")
        self.name, self.ranks, self.index = name, tuple(ranks), ranks.index(rank)
        prefixed = dist.PrefixStore(f"maspo/bridge/{name}", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg: Any = dist.ProcessGroupNCCL(prefixed, self.index, len(ranks), opts)
            self.device = local_device()
        else:
            self._pg = dist.ProcessGroupGloo(prefixed, self.index, len(ranks), timeout)
            self.device = torch.device("cpu")

    @property
    def size(self) -> int:
        return len(self.ranks)

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """In-place broadcast of ``t`` from member ``root`` (an index into ``ranks``); returns ``t``."""
        buf = t if t.device == self.device and t.is_contiguous() else t.to(self.device).contiguous()
        self._pg.broadcast(buf, root).wait()
        return _write_back(t, buf)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """A picklable object from member ``root`` to every member (length, then the pickled bytes)."""
        import pickle

        if self.index == root:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                    dtype=torch.uint8)
            n = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            n = torch.zeros(1, dtype=torch.int64)
        self.broadcast(n, root)
        if self.index != root:
            data = torch.empty(int(n.item()), dtype=torch.uint8)
        self.broadcast(data, root)
        return obj if self.index == root else pickle.loads(data.numpy().tobytes())

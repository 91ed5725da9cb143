"""Process groups between pools (:class:`Bridge`), and the whole set of them built in one pass
(:func:`build_bridges`).

A disaggregated job joins its pools with one (payload, header) pair of bridges per weight sender and a
``batches`` bridge (``PoolLayout.bridge_comms``). At scale the payload bridges are the costly ones: an
engine owner joins one per sender, and each NCCL communicator has its own ring buffers, proxy threads and
watchdog. Here they are bounded and made before anything else takes the GPU:

- **Eager, device bound, one pass.** Every rank walks ``bridge_comms`` in its one global order at start-up
  (the rollout pool before its engine exists). A device bridge's NCCL communicator is created in its
  constructor (``bound_device_id`` + ``eager_connect_single_device``) and warmed up by a one-byte
  broadcast, so its ring connections and buffers are allocated then (NCCL connects lazily, at the first
  collective, by default), not at the first sync after vLLM has taken its share of the GPU.
- **Split from one parent.** With several links, a ``weights_parent`` communicator over every sender and
  owner is made first; each link's is an ``ncclCommSplit`` of it (``ProcessGroupNCCL.Options.split_from``
  / ``split_color``; members not in a link take part with ``perform_nocolor_split``), so no link needs a
  NCCL id of its own through the store or a bootstrap from scratch.
- **Bounded channels, no resource sharing.** Each payload communicator has at most ``channels`` channels
  (``ncclConfig_t.maxCTAs``), which bounds its buffers (``parallel/link_budget.py``). The splits do not
  share the parent's resources (``splitShare``): NCCL then orders every kernel of the parent and its
  children on one internal stream per rank, so links an owner drains side by side would complete in each
  rank's own posting order, which differs between owners (a deadlock); and a link's ring neighbours are
  mostly its own sender, so sharing would save little.
- **Lazy gloo.** Each host group's TCP device connects on first use (a socket per peer its broadcasts
  actually use, not a full mesh) and has one worker thread (a bridge is used by one thread at a time).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_maspo.parallel import comm, group_plan
from megatron_maspo.parallel import gpu_emulation as _emu
from megatron_maspo.parallel.device import on_cuda


def _members_share_a_gpu(store: Any, index: int, size: int) -> bool:
    """Whether two members of a group compute on one GPU (each publishes :func:`comm.gpu_identity`)."""
    store.set(f"gpu/{index}", comm.gpu_identity())
    ids = [store.get(f"gpu/{i}").decode() for i in range(size)]
    return len(set(ids)) < size


def host_options(timeout: datetime.timedelta) -> Any:
    """``ProcessGroupGloo`` options for a bridge: its own TCP device(s) connecting lazily (on the
    ``GLOO_SOCKET_IFNAME`` interfaces when set, as torch's default does) and one worker thread.

    A device is not shared between groups: gloo's lazy connection mixes up two groups' pairs on one.
    """
    gloo = dist.ProcessGroupGloo
    opts = gloo._Options()
    opts._timeout = timeout
    opts._threads = 1
    ifnames = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    opts._devices = ([gloo.create_device(interface=i, lazy_init=True) for i in ifnames] if ifnames
                     else [gloo.create_default_device(lazy_init=True)])
    return opts


def nccl_group(store: Any, index: int, size: int, timeout: datetime.timedelta, *, channels: int | None = None,
               parent: Any = None, color: int = 0) -> Any:
    """An NCCL communicator on this process's GPU, created now (bound and eagerly connected).

    Args:
        channels: at most this many channels (``ncclConfig_t.maxCTAs``); None: NCCL's choice.
        parent: a ``ProcessGroupNCCL`` already connected on this GPU to split from (``ncclCommSplit``
            with colour ``color``; every other member of the parent calls :meth:`SplitParent.skip`).
    """
    device = comm.local_device()
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    if channels is not None:
        opts.config.max_ctas = channels
    if parent is not None:
        opts.split_from, opts.split_color = parent, color
    pg = dist.ProcessGroupNCCL(store, index, size, opts)
    pg.bound_device_id = device
    pg.eager_connect_single_device(device)
    return pg


class SplitParent:
    """The NCCL communicator the weight links' payload communicators are split from (``weights_parent``).

    It carries no collective. On CUDA it is a ``ProcessGroupNCCL`` connected in the constructor; off CUDA
    nothing (the links are gloo groups of their own) and only counted under the emulation. ``usable`` is
    False where two members share a GPU (NCCL refuses that): the links are then made on their own.
    """

    def __init__(self, store: Any, name: str, ranks: tuple[int, ...], rank: int, *, timeout_s: float) -> None:
        prefixed = dist.PrefixStore(f"maspo/bridge/{name}", store)
        self.name, self.ranks, self.index = name, tuple(ranks), ranks.index(rank)
        self.usable = not _members_share_a_gpu(prefixed, self.index, len(ranks))
        self.pg: Any = None
        if self.usable and on_cuda():
            self.pg = nccl_group(prefixed, self.index, len(ranks), datetime.timedelta(seconds=timeout_s))
        if self.usable:
            _emu.record_group(self, group_plan.NCCL, f"split parent {name!r}", self.ranks)

    def skip(self) -> None:
        """Take part in a split this rank is not in (NCCL needs every member of the parent in each)."""
        if self.pg is not None:
            self.pg.perform_nocolor_split(comm.local_device())


class Bridge:
    """A process group across pools, outside torch's group registry (the default group of each pool
    holds only that pool's ranks, so ``new_group`` cannot span them).

    Built straight on the job store under ``maspo/bridge/<name>``; ``ranks`` are global ranks and index 0
    is the usual root. Two kinds:

    - ``device=False``: a host bridge (gloo, CPU tensors, lazy connections, one worker thread): control
      messages, pickled batches. A pending receive on it blocks only its calling thread.
    - ``device=True``: tensors on this process's GPU (weights between GPU pools): NCCL, created and
      connected in the constructor, unless two members compute on one GPU (NCCL refuses that; the one-GPU
      smoke test), then gloo with host staging. ``split_from`` (a usable :class:`SplitParent`) makes its
      communicator a split of the parent's with colour ``color``; ``channels`` caps its NCCL channels.
      An NCCL receive that waits for its sender holds the calling thread's *stream*: post one only once
      the sender is known to be sending (a header on a host bridge), from a side stream
      (:func:`comm.side_stream`).

    Every member must call each operation in the same order, and one bridge is used by one thread at a
    time. Its store waits (and gloo's connection set-up) use ``timeout_s``: build it with the wait the
    slowest member may need to arrive (the rollout pool waits for a trainer that loads a checkpoint
    first). The constructor returns once every member has joined and a one-byte broadcast went through.
    """

    def __init__(self, store: Any, name: str, ranks: tuple[int, ...], rank: int, *, device: bool = False,
                 timeout_s: float = 1800.0, split_from: SplitParent | None = None, color: int = 0,
                 channels: int | None = None) -> None:
        if rank not in ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"bridge {name!r}: rank {rank} not among distinct ranks {ranks}")
        if split_from is not None and not (device and split_from.usable):
            raise ValueError(f"bridge {name!r}: only a device bridge splits, from a usable parent")
        self.name, self.ranks, self.index = name, tuple(ranks), ranks.index(rank)
        prefixed = dist.PrefixStore(f"maspo/bridge/{name}", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        # a usable parent has already found every member on its own GPU
        shared = device and split_from is None and _members_share_a_gpu(prefixed, self.index, len(ranks))
        self.gpu_backend = group_plan.gpu_backend(carries_device=device, members_share_a_gpu=shared)
        """The backend this bridge has on GPUs (``maspo check`` plans it with the same rule; the emulation
        records it)."""
        self.on_device = device and not shared
        """Whether tensors travel in device memory (staged there if given on the host)."""
        if self.gpu_backend == group_plan.NCCL and on_cuda():
            parent = split_from.pg if split_from is not None else None
            self._pg: Any = nccl_group(prefixed, self.index, len(ranks), timeout, channels=channels,
                                       parent=parent, color=color)
            self.device = comm.local_device()
        else:
            self._pg = dist.ProcessGroupGloo(prefixed, self.index, len(ranks), host_options(timeout))
            self.device = torch.device("cpu")
        what = "device tensors" if self.on_device else ("host only: two members share a GPU" if device
                                                        else "host only: control messages and pickled data")
        _emu.record_group(self._pg, self.gpu_backend, f"bridge {name!r} ({what})", self.ranks)
        self._warm_up()

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _warm_up(self) -> None:
        """One byte from member 0: NCCL allocates its ring buffers and gloo connects its tree now."""
        buf = comm.device_empty(1) if self.on_device else torch.empty(1, dtype=torch.uint8)
        self.broadcast(buf, 0)
        comm.synchronize_stream()
        _emu.release(self._pg)  # built on this thread, used from another (the receiver's)

    def _stage(self, t: torch.Tensor, root: int) -> torch.Tensor:
        """``t`` itself where this bridge takes it as is, else a buffer on the bridge's device: the root's
        bytes copied there, a receiver's left uninitialised (the broadcast overwrites them)."""
        receiving = self.index != root
        if self.on_device and _emu.active():
            if _emu.is_device(t) and t.is_contiguous():
                return t
            return _emu.device_like(t) if receiving else _emu.to_device(t)
        if t.device == self.device and t.is_contiguous():
            return t
        if receiving:
            return torch.empty(t.shape, dtype=t.dtype, device=self.device)
        return t.to(self.device).contiguous()

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """In-place broadcast of ``t`` from member ``root`` (an index into ``ranks``); returns ``t``.

        On a device bridge the host is not held: the collective is queued on the calling thread's current
        stream (NCCL's ``wait()`` makes that stream wait), so read ``t`` (or synchronise the stream)
        before using it on another. A host ``t`` goes through the device: the root's bytes up, the
        receivers' back down (one copy each; pinned where ``t`` is registered, ``comm.pin_host``).
        """
        buf = self._stage(t, root)
        if _emu.active():
            if self.on_device:
                _emu.device_collective(self._pg, f"Bridge.broadcast ({buf.numel() * buf.element_size()} B)",
                                       lambda: self._pg.broadcast(buf, root), (buf,), async_op=True)
            else:
                _emu.device_collective(self._pg, "Bridge.broadcast", lambda: self._pg.broadcast(buf, root).wait(),
                                       (t,))
        else:
            self._pg.broadcast(buf, root).wait()
        if self.index != root and buf is not t:
            t.copy_(buf)
        return t

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


def build_bridges(store: Any, comms: Sequence[group_plan.CommSpec], rank: int, *, timeout_s: float,
                  channels: int | None = None) -> dict[str, Bridge]:
    """This rank's bridges of ``comms`` (``PoolLayout.bridge_comms``), by name, built in one pass.

    Every rank of the job walks ``comms`` in the same order: a group's members block in its constructor
    until all have joined (each for up to ``timeout_s``), and a split involves every member of its
    parent, so one order is what keeps the pass free of deadlocks.

    Args:
        channels: the NCCL channel cap of each payload communicator (``rollout.weight_link_channels``).
    """
    parents: dict[str, SplitParent] = {}
    out: dict[str, Bridge] = {}
    for c in comms:
        if c.role == group_plan.PARENT:
            if rank in c.ranks:
                parents[c.name] = SplitParent(store, c.name, tuple(c.ranks), rank, timeout_s=timeout_s)
            continue
        parent = parents.get(c.parent) if c.parent is not None else None
        split_from = parent if parent is not None and parent.usable else None
        if rank in c.ranks:
            payload = c.role == group_plan.PAYLOAD
            out[c.name] = Bridge(store, c.name, tuple(c.ranks), rank, device=payload, timeout_s=timeout_s,
                                 split_from=split_from if payload else None, color=c.color,
                                 channels=channels if payload else None)
        elif split_from is not None and c.role == group_plan.PAYLOAD:
            split_from.skip()
    return out

"""Weights from the training pool to the rollout pool: a header and a payload per bucket.

The trainer's sync is unchanged (``weight_sync.sync_weights``: export, reshard to full HF tensors, pack
buckets); on the training pool's sender its destination is a :class:`WeightSender`, which sends each
bucket to every engine owner instead of loading it into a local engine. Two bridges on the same ranks
(``rollout/pools.py``):

    ``weights_ctl`` (host, gloo)   {"bucket": metas, crc, index, n}    per bucket, then {"end"} per sync,
                                   (+ "digests", rollout/digest.py)    {"stop"} once at the end
    ``weights`` (device, NCCL)     the n-byte bucket, GPU to GPU        posted only after its header

Why two: an NCCL receive waiting for its sender holds the receiving thread's CUDA stream (``wait()``
makes the current stream wait for the collective). If the receiver thread sat in the next sync's
broadcast on the default stream, which every thread of the engine process shares, every host read of
the engine loop (a checksum's ``.cpu()``, a decode step's ``bool(done.all())``, the pool's object
gather) would wait for the trainer's next sync, which comes only after the batch the engine cannot
make: the rollout pool's first-generation hang. So between syncs the receiver waits on the host bridge
(it blocks that thread only, for as long as ``rollout.pool_timeout_s``, and no NCCL work is pending
under the NCCL watchdog), posts each payload only once its header has arrived (the trainer is sending
it), on a side stream of its own, and synchronises that stream before it hands the sync over.

On an NCCL bridge the buckets go from the trainer's GPU to the engine owner's GPU with no host copy:
the sender packs them in device memory (:meth:`WeightSender.bucket_pool`), the receivers get them in
device memory, and no crc32 runs (a checksum is a device-to-host copy; it guards host transports). Two
members on one GPU (the one-GPU smoke test) get a gloo ``weights`` bridge and host buckets with checksums.

Double-buffered: the engine generates with version v while version v+1 lands in the slot, so the
trainer's broadcast waits only for the transfer, never for the engine to finish a batch. The receiver
waits for the slot to be free before it takes the next sync; the schedule (one version per step) never
lets more than one sync queue up, so that wait is a guard, not a stall. A vLLM engine then relays each
staged bucket to its workers through its own ``ipc`` / ``bytes`` transport (``VllmEngine.load_buckets``).
With ``ipc`` the receiver stages into the engine's ``staging_pool()``: host shared memory (``/dev/shm``,
on GPU too, so a staged sync never takes GPU memory from vLLM), each bucket received in place and mapped by
the workers without a copy, the buffers recycled once applied. Budget ``/dev/shm`` for about two syncs
(one being applied, the next landing) of the model's bytes in the engine dtype.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from megatron_maspo.parallel import comm
from megatron_maspo.parallel.device import on_cuda
from megatron_maspo.rollout.buckets import Bucket, checksum, meta_from_wire, meta_to_wire

logger = logging.getLogger(__name__)


class WeightSender:
    """What a sync loads into on a training-pool sender: every bucket goes to the engine owners, its header
    over ``ctl`` (host) and its bytes over ``bridge`` (device where the pools have GPUs; the trainer's side
    of :class:`WeightReceiver`).

    Args:
        bridge, ctl: this sender's first link (``rollout.sync_transport=broadcast``: its only one, to every
            owner).
        more: further ``(bridge, ctl)`` links (``p2p``: one per further owner); each bucket goes over each
            link in turn (its payload bytes still count once in ``sync/sender_bytes_max``).
        lead: this sender ends the rollout pool (:meth:`stop`): trainer rank 0, whose links every
            receiver reads first (:class:`FanIn`).
    """

    def __init__(self, bridge: Any, ctl: Any, *, more: Sequence[tuple[Any, Any]] = (), lead: bool = True) -> None:
        self.bridge, self.ctl = bridge, ctl
        self.links = [(bridge, ctl), *more]
        self.lead = lead
        self._version = 0
        self._pool: Any = None

    @property
    def policy_version(self) -> int:
        """Syncs sent (the engines' load count once they have applied them all)."""
        return self._version

    def bucket_pool(self, bucket_bytes: int) -> Any:
        """Device buffers to pack into when the bucket bytes travel GPU to GPU (``sync_weights`` packs
        bucket k+1 while bucket k is sent, and skips checksums); None over a host bridge (fresh host
        buffers, checksummed)."""
        if not self.bridge.on_device:
            return None
        # On a GPU the two buffers (2 x rollout.bucket_mb) are made per sync and dropped after it, so the
        # caching allocator hands their memory back to training; elsewhere they are kept across syncs.
        if self._pool is None or self._pool.capacity != bucket_bytes or on_cuda():
            from megatron_maspo.rollout.transport import BucketPool

            self._pool = BucketPool(bucket_bytes, make=comm.device_empty)
        self._pool.reclaim()  # a sync that failed half-way leaves no buffer taken
        return self._pool

    def load_buckets(self, buckets: Iterable[Bucket], *, verify: bool = True) -> None:
        for b in buckets:
            try:
                header = {"bucket": [meta_to_wire(m) for m in b.metas], "crc": b.checksum, "index": b.index,
                          "n": b.buffer.numel(), "verify": verify, "digests": b.digests}
                for bridge, ctl in self.links:
                    ctl.broadcast_object(header)
                    bridge.broadcast(b.buffer, 0)
            finally:
                b.done()  # NCCL: the pool's next pack into this buffer is queued behind the broadcast
        for _, ctl in self.links:
            ctl.broadcast_object({"end": True})
        self._version += 1
        if on_cuda():
            self._pool = None

    def stop(self) -> None:
        """Tell every engine owner that no sync follows (its receiver thread ends); only the lead sender
        sends it (the others' links are not read between syncs)."""
        if self.lead:
            for _, ctl in self.links:
                ctl.broadcast_object({"stop": True})


class FanIn:
    """Several senders' ``(bridge, ctl)`` links read as the one pair a :class:`WeightReceiver` takes.

    One sync arrives as link 0's headers and payloads until its ``end``, then link 1's, ... (the plan's
    sender order, rank 0 first); the ``end`` of the last link is passed on, the earlier ones are merged
    into it (a dict-valued key is updated, any other key kept from the last). ``stop`` comes on link 0
    (trainer rank 0, the lead sender). A payload is received from the link its header came on. Use
    :attr:`ctl` and :attr:`bridge` in place of the receiver's two bridges (one thread, as a bridge).
    """

    def __init__(self, links: Sequence[tuple[Any, Any]]) -> None:
        if not links:
            raise ValueError("FanIn: no link")
        self.links = list(links)
        self._at = 0
        self._ends: dict = {}
        self.ctl, self.bridge = _FanInCtl(self), _FanInBridge(self)

    def next_message(self) -> dict:
        while True:
            msg = self.links[self._at][1].broadcast_object(None, 0)
            if "end" not in msg:
                return msg
            for k, v in msg.items():
                if isinstance(v, dict) and isinstance(self._ends.get(k), dict):
                    self._ends[k] = {**self._ends[k], **v}
                else:
                    self._ends[k] = v
            if self._at + 1 < len(self.links):
                self._at += 1
                continue
            end, self._at, self._ends = self._ends, 0, {}
            return end


class _FanInCtl:
    def __init__(self, fan: FanIn) -> None:
        self._fan = fan

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        if obj is not None or root != 0:
            raise ValueError("FanIn: a receiver only reads headers from the senders")
        return self._fan.next_message()


class _FanInBridge:
    def __init__(self, fan: FanIn) -> None:
        self._fan = fan
        self.on_device = fan.links[0][0].on_device

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        return self._fan.links[self._fan._at][0].broadcast(t, root)


class WeightReceiver:
    """An engine owner's receiving end: a thread takes each sync into one staging slot.

    Args:
        bridge: the ``weights`` bridge (payloads; this rank a non-root member); used by this thread only.
        ctl: the ``weights_ctl`` host bridge on the same ranks (headers, end, stop).
        device: where staged buckets live (the engine's device; host memory on CPU).
        staging: where staged buckets live instead, when the engine wants them somewhere particular
            (``engine.staging_pool()``: a vLLM engine's ``ipc`` transport takes shared-memory buffers,
            so each bucket is received straight into memory its workers map; recycled across syncs).
            Its buffers go back to it as the engine finishes each bucket (``Bucket.done``).
    """

    def __init__(self, bridge: Any, ctl: Any, *, device: torch.device | str = "cpu", staging: Any = None) -> None:
        self.bridge, self.ctl, self.device, self.staging = bridge, ctl, torch.device(device), staging
        self._cond = threading.Condition()
        self._slot: list[Bucket] | None = None
        self._verify = True
        self.stopped = False
        self.error: BaseException | None = None
        self.received = 0
        """Syncs received so far (applied or staged)."""
        self.applied: list[dict] = []  # per applied sync: its pause and verification cost (pop_applied)
        self._verifier: threading.Thread | None = None  # a deferred digest check in flight (settle)
        self._verify_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="maspo-weight-receiver", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ receiver thread
    def _receive(self, n: int) -> tuple[torch.Tensor, Any]:
        """Post the receive of one n-byte bucket (on this thread's side stream); (buffer, release)."""
        if self.staging is not None:  # host shared memory the engine's workers map (the bridge stages)
            buf, release = self.staging.alloc(n)
            self.bridge.broadcast(buf, 0)
            return buf, release
        on_device = self.bridge.on_device
        buf = comm.device_empty(n) if on_device else torch.empty(n, dtype=torch.uint8)
        self.bridge.broadcast(buf, 0)
        if not on_device and buf.device != self.device:
            buf = buf.to(self.device)
        return buf, None

    def _run(self) -> None:
        try:
            with comm.side_stream("weight receiver's stream") as stream:
                while True:
                    staged: list[Bucket] = []
                    while True:
                        msg = self.ctl.broadcast_object(None, 0)  # host: holds no stream while it waits
                        if "stop" in msg:
                            with self._cond:
                                self.stopped = True
                                self._cond.notify_all()
                            return
                        if "end" in msg:
                            break
                        buf, release = self._receive(msg["n"])
                        staged.append(Bucket(buf, [meta_from_wire(w) for w in msg["bucket"]], msg["crc"],
                                             msg["index"], release=release, digests=msg.get("digests")))
                        self._verify = bool(msg["verify"])
                    stream.synchronize()  # every payload landed before the engine loop reads one
                    check_complete(staged)  # here, off the engine loop: a bad sync never reaches it
                    for b in staged:
                        comm.record_for_default_stream(b.buffer)
                    with self._cond:
                        # one staged sync at a time: the schedule never sends the next before this one is used
                        while self._slot is not None:
                            self._cond.wait()
                        self._slot = staged
                        self.received += 1
                        self._cond.notify_all()
        except BaseException as e:  # a dead trainer or a broken bridge: the engine loop re-raises it
            with self._cond:
                self.error = e
                self._cond.notify_all()

    # ------------------------------------------------------------ engine loop side
    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"weight receiver: the bridge from the training pool failed: {self.error!r}") \
                from self.error

    def apply_staged(self, engine: Any) -> bool:
        """Load the staged sync into ``engine`` if one is waiting (non-blocking); True if it loaded."""
        with self._cond:
            self._raise_if_failed()
            slot, self._slot = self._slot, None
            if slot is not None:
                self._cond.notify_all()
        if slot is None:
            return False
        self.settle()  # the last sync's deferred check reads the parameters this load overwrites
        t0 = time.perf_counter()
        try:
            # the crc32s were checked when the sync was staged (check_complete cleared them): the engine
            # loop pauses only for the copy-in (or the relay to vLLM's workers) and the digest check
            engine.load_buckets(slot, verify=self._verify)
        finally:
            for b in slot:  # pooled buffers back to the staging pool (no-op for those the engine released)
                b.done()
        entry = {"engine_pause_s": time.perf_counter() - t0, "verify_s": engine.verify_s,
                 "verify_full_s": engine.verify_full_s}
        self.applied.append(entry)
        check = engine.deferred_check()
        if check is not None:  # the digest check runs beside generation: the pause was the copy-in only
            self._verifier = threading.Thread(target=self._check, args=(check, engine, entry),
                                              name="maspo-weight-verifier", daemon=True)
            self._verifier.start()
        return True

    def _check(self, check: Callable[[], None], engine: Any, entry: dict) -> None:
        """The verifier thread: a deferred digest check of the weights the engine now holds, on a stream
        of its own behind the copy-in (which ran on the engine loop's default stream)."""
        try:
            if engine.device.type == "cuda":
                torch.cuda.set_device(engine.device)  # a new thread starts on GPU 0
            with comm.side_stream("weight verifier's stream") as stream:
                if on_cuda():
                    stream.wait_stream(torch.cuda.default_stream(engine.device))
                check()
            entry["verify_s"], entry["verify_full_s"] = engine.verify_s, engine.verify_full_s
        except BaseException as e:  # re-raised in the engine loop by settle()
            self._verify_error = e

    def settle(self) -> None:
        """Wait for the deferred digest check of the last applied sync and re-raise its failure
        (``WeightVerifyError``). Call before anything made with those weights leaves the engine."""
        if self._verifier is not None:
            self._verifier.join()
            self._verifier = None
        if self._verify_error is not None:
            err, self._verify_error = self._verify_error, None
            raise err

    def pop_applied(self) -> list[dict]:
        """Per sync applied since the last call (after :meth:`settle`, which may raise):
        ``engine_pause_s`` (the engine loop's wall time in :meth:`apply_staged`: no token is generated
        meanwhile), ``verify_s`` (its digest check, in the pause or beside generation) and
        ``verify_full_s``."""
        self.settle()
        out, self.applied = self.applied, []
        return out

    def wait_for(self, ready: Callable[[], bool], engine: Any, *, timeout_s: float = 1800.0,
                 what: str = "weights", log_every_s: float = 300.0) -> bool:
        """Apply staged syncs one by one until ``ready()``; False when the trainer said stop first.

        Logs what it waits for every ``log_every_s`` (the first sync comes only after the trainer has
        built its model, loaded its checkpoint and warmed up: minutes to an hour at 70B).

        Raises:
            RuntimeError: the receiver failed, or nothing arrived for ``timeout_s``
                (``rollout.pool_timeout_s``).
        """
        waited = 0.0
        while not ready():
            if self.apply_staged(engine):
                waited = 0.0
                continue
            with self._cond:
                idle = self._slot is None and not self.stopped and self.error is None
                if idle:
                    step = min(log_every_s, timeout_s - waited)
                    if not self._cond.wait(step) and self._slot is None and not self.stopped:
                        waited += step
                        if waited >= timeout_s:
                            raise RuntimeError(f"weight receiver: no {what} from the training pool for "
                                               f"{timeout_s:.0f} s (rollout.pool_timeout_s)")
                        logger.info("rollout pool: waiting for %s from the training pool (%.0f s so far, "
                                    "rollout.pool_timeout_s=%.0f)", what, waited, timeout_s)
                self._raise_if_failed()
                if self.stopped and self._slot is None:
                    return False
        return True

    def join(self, timeout_s: float = 60.0) -> None:
        self._thread.join(timeout_s)


def check_complete(staged: list[Bucket]) -> None:
    """Before a staged sync may be activated: every bucket's crc32 matches (host buffers; device buffers
    carry none) and every tensor's bytes arrived whole (each split tensor's pieces tile it in order).
    A bucket whose crc32 matched has its ``checksum`` cleared: the engine need not compute it again.

    Raises:
        ValueError: naming the bucket or the tensor; the sync is then never handed to the engine.
    """
    got: dict[str, int] = {}
    for b in staged:
        if b.checksum is not None and not b.buffer.is_cuda:
            crc = checksum(b.buffer)
            if crc != b.checksum:
                raise ValueError(f"weight-sync bucket {b.index} arrived corrupted: crc32 {crc:#010x} != sent "
                                 f"{b.checksum:#010x}; the staged version is discarded")
            b.checksum = None
        for m in b.metas:
            if m.offset + m.span > b.buffer.numel():
                raise ValueError(f"tensor {m.name!r} spans beyond bucket {b.index} ({b.buffer.numel()} bytes)")
            start = 0 if m.part is None else m.part[0]
            if got.get(m.name, 0) != start:
                raise ValueError(f"weight sync: tensor {m.name!r} bytes from {start} arrived after "
                                 f"{got.get(m.name, 0)}; the staged version is discarded")
            got[m.name] = start + m.span
    size = {m.name: m.nbytes for b in staged for m in b.metas}
    short = sorted(n for n, nbytes in size.items() if got[n] != nbytes)
    if short:
        raise ValueError(f"weight sync ended with tensors incomplete: {short[:4]}; the staged version is discarded")

"""Weights from the training pool to the rollout pool: a header and a payload per bucket.

The trainer's sync is unchanged (``weight_sync.sync_weights``: export, reshard to full HF tensors, pack
buckets); on the training pool's sender its destination is a :class:`WeightSender`, which sends each
bucket to every engine owner instead of loading it into a local engine. Two bridges on the same ranks
(``rollout/pools.py``):

    ``weights_ctl`` (host, gloo)   {"bucket": metas, crc, index, n}    per bucket, then {"end"} per sync,
                                   (+ "digests", rollout/digest.py)    {"stop"} once at the end (every
                                                                       sender; the lead's ends the pool)
    ``weights`` (device, NCCL)     the n-byte bucket, GPU to GPU        posted only after its header

With ``rollout.sync_senders=stages`` each sender has such a pair of its own (``PoolLayout.weight_links``),
or, past ``rollout.max_weight_links`` senders, shares one with other senders: the link's senders take turns
in rank order, each sending its buckets and its ``end`` from its own member index while every other member
(the other senders too, into a scratch buffer) takes part. An owner drains all links at once
(:class:`WeightReceiver`) and stages the sync once every turn of every link has sent its ``end``, in the
export's global order.

Why two: an NCCL receive waiting for its sender holds the receiving thread's CUDA stream (``wait()``
makes the current stream wait for the collective). If the receiver thread sat in the next sync's
broadcast on the default stream, which every thread of the engine process shares, every host read of
the engine loop (a checksum's ``.cpu()``, a decode step's ``bool(done.all())``, the pool's object
gather) would wait for the trainer's next sync, which comes only after the batch the engine cannot
make: the rollout pool's first-generation hang. So between syncs the receiver waits on the host bridge
(it blocks that thread only, for as long as ``rollout.pool_timeout_s``, and no NCCL work is pending
under the NCCL watchdog), posts each payload only once its header has arrived (the trainer is sending
it), on a side stream of its own (one per link), and synchronises that stream before it hands the sync
over. The sender, likewise, posts its payloads on a send stream of its own, so its export goes on while
a bucket is on the wire (:class:`WeightSender`).

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
the workers without a copy, the buffers recycled once applied (a staged buffer cut into several runs
for the export order goes back once the last of them is loaded). Budget ``/dev/shm`` for about two syncs
(one being applied, the next landing) of the model's bytes in the engine dtype.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from megatron_maspo.parallel import comm, streams
from megatron_maspo.parallel.device import on_cuda
from megatron_maspo.rollout.buckets import Bucket, meta_from_wire, meta_to_wire
from megatron_maspo.rollout.staged import check_complete, in_export_order

__all__ = ["WeightReceiver", "WeightSender", "check_complete"]

logger = logging.getLogger(__name__)


class WeightSender:
    """What a sync loads into on a training-pool sender: every bucket goes to the engine owners, its header
    over ``ctl`` (host) and its bytes over ``bridge`` (device where the pools have GPUs; the trainer's side
    of :class:`WeightReceiver`).

    Over a device bridge the payloads are posted on a send stream of this sender's own, not on the default
    stream the prefetch thread exports and packs on (``weight_sync._send``): events order the two
    (``parallel/streams.py``): the send waits for the bucket's pack (``Bucket.ready``), and its buffer
    is packed into again only after the send's event (``Bucket.done(after=...)``). So the export of the
    next buckets (its TP gathers included) runs while a bucket is on the wire, and the sync's end waits
    for the last send.

    Args:
        bridge, ctl: this sender's first link (``rollout.sync_transport=broadcast``: its only one, to every
            owner).
        more: further ``(bridge, ctl)`` links (``p2p``: one per further owner); each bucket goes over each
            link in turn (its payload bytes still count once in ``sync/sender_bytes_max``).
        lead: this sender's ``stop`` ends the rollout pool: trainer rank 0's (the owners' first link).
        turn, turns: this sender's turn on its (one) link and the link's number of senders
            (``WeightLink.senders``); with ``turns > 1`` each sync and the stop take part in every other
            sender's turn too, before and after this one's.
    """

    def __init__(self, bridge: Any, ctl: Any, *, more: Sequence[tuple[Any, Any]] = (), lead: bool = True,
                 turn: int = 0, turns: int = 1) -> None:
        if not 0 <= turn < turns or (turns > 1 and more):
            raise ValueError(f"weight sender: turn {turn} of {turns} (a shared link is a sender's only one)")
        self.bridge, self.ctl = bridge, ctl
        self.links = [(bridge, ctl), *more]
        self.lead = lead
        self.turn, self.turns = turn, turns
        self._version = 0
        self._pool: Any = None
        self._stream: Any = None

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

            self._pool = BucketPool(bucket_bytes, make=comm.device_empty, events=True)
        self._pool.reclaim()  # a sync that failed half-way leaves no buffer taken
        return self._pool

    def _send_stream(self) -> Any:
        if self._stream is None and self.bridge.on_device:
            self._stream = streams.new_stream("weight sender's send stream")
        return self._stream

    def _take_part(self, turns: Iterable[int], stream: Any, scratch: list) -> None:
        """Take part in other senders' turns on the shared link: each header, then each bucket's bytes
        received into one scratch buffer (on the send stream, in posting order: reused, never read)."""
        for root in turns:
            while "end" not in (msg := self.ctl.broadcast_object(None, root)):
                n = msg["n"]
                with streams.using(stream):
                    if not scratch or scratch[0].numel() < n:
                        scratch[:] = [comm.device_empty(n) if self.bridge.on_device else torch.empty(n, dtype=torch.uint8)]
                    self.bridge.broadcast(scratch[0][:n], root)

    def load_buckets(self, buckets: Iterable[Bucket], *, verify: bool = True) -> None:
        stream = self._send_stream()
        scratch: list = []  # held until the stream is synchronised below
        root = self.turn
        try:
            self._take_part(range(self.turn), stream, scratch)
            for b in buckets:
                sent = None
                try:
                    header = {"bucket": [meta_to_wire(m) for m in b.metas], "crc": b.checksum, "index": b.index,
                              "n": b.buffer.numel(), "verify": verify, "digests": b.digests}
                    for bridge, ctl in self.links:
                        ctl.broadcast_object(header, root)
                        with streams.using(stream):
                            streams.wait(b.ready, stream)  # the pack of this bucket, on the packing stream
                            bridge.broadcast(b.buffer, root)
                    sent = streams.record(stream)
                finally:
                    b.done(after=sent)  # the pool's next pack into this buffer waits for the send
            for _, ctl in self.links:
                ctl.broadcast_object({"end": True}, root)
            self._take_part(range(self.turn + 1, self.turns), stream, scratch)
        finally:
            streams.synchronize(stream)  # every payload on the wire has landed: pool buffers may be freed
        self._version += 1
        if on_cuda():
            self._pool = None

    def stop(self) -> None:
        """Tell the engine owners that no sync follows: every sender ends its links' receiver threads; the
        lead's (trainer rank 0's) ends the receivers themselves. On a shared link every sender says it in
        its turn and reads the others'."""
        for t in range(self.turns):
            for _, ctl in self.links:
                ctl.broadcast_object({"stop": True} if t == self.turn else None, t)


class WeightReceiver:
    """An engine owner's receiving end: one thread per sender link drains that link, and one more merges a
    sync from every link into one staging slot.

    The links are read all at once, never one after another: a sender's export may wait for another
    sender (an EP rank that is also a TP peer of its stage's dense sender joins that sender's TP
    gathers of every layer, ``transfer_plan``'s docstring), so an owner that read link 1 only after
    link 0's ``end`` would leave EP rank 1 blocked in its first header, its prefetch stopped after two
    buckets and rank 0 waiting in a gather: a hang until ``rollout.pool_timeout_s``. Each link thread
    posts its payload receives on a side stream of its own, synchronises it at its link's ``end`` and
    hands that link's buckets over; once every link has, the sync is checked (:func:`~.staged.check_complete`),
    put in the export's global order when ``order`` is given (:func:`~.staged.in_export_order`: vLLM then
    gets each layer whole before the next), and staged. A link thread reads the next sync only once this
    one is staged, so at most one sync is in flight beside the staged one. ``stop`` on the first link (the
    lead sender, trainer rank 0) ends the receiver; a stop on another link ends that link's thread; a
    failure on any link fails the receiver (the engine loop re-raises it).

    Args:
        bridge: the first link's ``weights`` bridge (payloads; this rank a non-root member).
        ctl: the ``weights_ctl`` host bridge on the same ranks (headers, end, stop).
        more: further ``(bridge, ctl)`` links (``rollout.sync_senders=stages``), in the plan's sender order;
            each bridge is used by its link's thread only.
        turns: senders per link (``WeightLink.senders``; default one each): a link's thread reads each
            sync and the stop turn by turn, from member index 0, 1, ...
        device: where staged buckets live (the engine's device; host memory on CPU).
        staging: where staged buckets live instead, when the engine wants them somewhere particular
            (``engine.staging_pool()``: a vLLM engine's ``ipc`` transport takes shared-memory buffers,
            so each bucket is received straight into memory its workers map; recycled across syncs).
            Its buffers go back to it as the engine finishes each bucket (``Bucket.done``).
        order: HF names in the export's global order (``[s.name for s in plan.sends]``); with several
            links the engine gets the staged sync in this order; None = link order.
    """

    def __init__(self, bridge: Any, ctl: Any, *, more: Sequence[tuple[Any, Any]] = (),
                 device: torch.device | str = "cpu", staging: Any = None, order: Sequence[str] | None = None,
                 turns: Sequence[int] | None = None) -> None:
        self.bridge, self.ctl, self.device, self.staging = bridge, ctl, torch.device(device), staging
        self.links = [(bridge, ctl), *more]
        self.turns = list(turns) if turns is not None else [1] * len(self.links)
        if len(self.turns) != len(self.links) or min(self.turns) < 1:
            raise ValueError(f"weight receiver: turns {self.turns} for {len(self.links)} link(s)")
        self.order = {n: i for i, n in enumerate(order)} if order is not None else None
        self._cond = threading.Condition()
        self._slot: list[Bucket] | None = None
        self._slot_meta: dict = {}  # the staged sync's index (1-based, this process) and when it was staged
        self._verify = True
        self.stopped = False
        self.error: BaseException | None = None
        self.received = 0
        """Syncs received so far (applied or staged)."""
        self.applied: list[dict] = []  # per applied sync: its pause and verification cost (pop_applied)
        self._verifier: threading.Thread | None = None  # a deferred digest check in flight (settle)
        self._verify_error: BaseException | None = None
        self._inbox: queue.Queue[tuple[int, str, Any]] = queue.Queue()
        self._credit = [threading.Semaphore(1) for _ in self.links]  # a link may read its next sync
        self._link_threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._run, name="maspo-weight-receiver", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ receiver threads
    def _receive(self, bridge: Any, n: int, root: int) -> tuple[torch.Tensor, Any]:
        """Post the receive of one n-byte bucket from member ``root`` (on the calling link thread's side
        stream); (buffer, release)."""
        if self.staging is not None:  # host shared memory the engine's workers map (the bridge stages)
            buf, release = self.staging.alloc(n)
            bridge.broadcast(buf, root)
            return buf, release
        on_device = bridge.on_device
        buf = comm.device_empty(n) if on_device else torch.empty(n, dtype=torch.uint8)
        bridge.broadcast(buf, root)
        if not on_device and buf.device != self.device:
            buf = buf.to(self.device)
        return buf, None

    def _drain(self, i: int, device: torch.device | None) -> None:
        """Link ``i``'s thread: each sync's headers and payloads to its ``end``, then into the inbox."""
        from megatron_maspo.rollout.transport import bind_thread_device

        bridge, ctl = self.links[i]
        try:
            bind_thread_device(device)
            with comm.side_stream(f"weight link {i}'s receive stream") as stream:
                while True:
                    self._credit[i].acquire()  # the previous sync is staged (or none came yet)
                    staged: list[Bucket] = []
                    verify = True
                    for root in range(self.turns[i]):  # each sender of the link in its turn
                        while True:
                            msg = ctl.broadcast_object(None, root)  # host: holds no stream while it waits
                            if "stop" in msg:
                                if root != 0:
                                    raise RuntimeError(f"sender {root} of the link said stop in a sync")
                                for later in range(1, self.turns[i]):  # every sender of the link says it
                                    if "stop" not in ctl.broadcast_object(None, later):
                                        raise RuntimeError(f"sender {later} of the link sent after the stop")
                                self._inbox.put((i, "stop", None))
                                return
                            if "end" in msg:
                                break
                            buf, release = self._receive(bridge, msg["n"], root)
                            staged.append(Bucket(buf, [meta_from_wire(w) for w in msg["bucket"]], msg["crc"],
                                                 msg["index"], release=release, digests=msg.get("digests")))
                            verify = verify and bool(msg["verify"])
                    stream.synchronize()  # every payload landed before another thread reads one
                    for b in staged:
                        comm.record_for_default_stream(b.buffer)
                    self._inbox.put((i, "sync", (staged, msg, verify)))
        except BaseException as e:  # a dead sender or a broken bridge
            self._inbox.put((i, "error", e))

    def _run(self) -> None:
        from megatron_maspo.rollout.transport import caller_device

        try:
            device = caller_device()
            for i in range(len(self.links)):
                th = threading.Thread(target=self._drain, args=(i, device), name=f"maspo-weight-link{i}",
                                      daemon=True)
                self._link_threads.append(th)
                th.start()
            pending: list[list] = [[] for _ in self.links]
            ended: set[int] = set()  # links whose sender said stop
            while True:
                i, kind, val = self._inbox.get()
                if kind == "error":
                    raise RuntimeError(f"weight link {i} of {len(self.links)} failed: {val!r}") from val
                if kind == "stop":
                    if i == 0:  # the lead sender: no sync follows
                        with self._cond:
                            self.stopped = True
                            self._cond.notify_all()
                        return
                    ended.add(i)
                    continue
                if ended:
                    raise RuntimeError(f"weight link(s) {sorted(ended)} said stop, but link {i} sends another sync")
                pending[i].append(val)
                if all(pending):
                    self._stage([p.pop(0) for p in pending])
        except BaseException as e:  # a dead trainer or a broken bridge: the engine loop re-raises it
            with self._cond:
                self.error = e
                self._cond.notify_all()

    def _stage(self, parts: list[tuple[list[Bucket], dict, bool]]) -> None:
        """One sync from every link: check it, order it, wait for the slot, stage it, let the links go on."""
        staged = [b for bs, _, _ in parts for b in bs]  # link order: each sender's stream order
        check_complete(staged)  # here, off the engine loop: a bad sync never reaches it
        if self.order is not None and (len(parts) > 1 or self.turns[0] > 1):
            staged = in_export_order(staged, self.order)
        with self._cond:
            # one staged sync at a time: the schedule never sends the next before this one is used
            while self._slot is not None:
                self._cond.wait()
            self._slot = staged
            self._verify = all(v for _, _, v in parts)
            self.received += 1
            # the sync's last byte is staged on this engine (every link's stream synchronised): the end of
            # sync/transfer_s, on the wall clock the trainer's start is read on (train/rollouts/remote.py)
            self._slot_meta = {"sync": self.received, "staged_at": time.time()}
            self._cond.notify_all()
        for c in self._credit:
            c.release()

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
            meta = self._slot_meta
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
                 "verify_full_s": engine.verify_full_s, **meta}
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
        meanwhile), ``verify_s`` (its digest check, in the pause or beside generation),
        ``verify_full_s``, ``sync`` (the sync's index, 1-based, counted by this receiver as the senders count
        theirs) and ``staged_at`` (``time.time()`` when its last byte was staged here)."""
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
        """Wait (up to ``timeout_s`` in all) for the receiver and its link threads to end: after the lead's
        stop, every other sender's stop still arrives on its link before its process exits."""
        deadline = time.monotonic() + timeout_s
        for th in [self._thread, *self._link_threads]:
            th.join(max(0.0, deadline - time.monotonic()))

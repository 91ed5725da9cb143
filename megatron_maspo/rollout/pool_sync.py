"""Weights from the training pool to the rollout pool: a broadcast per bucket, staged on the engine side.

The trainer's sync is unchanged (``weight_sync.sync_weights``: export, reshard to full HF tensors, pack
buckets); on the training pool's sender its destination is a :class:`WeightSender`, which broadcasts each
bucket over the ``weights`` bridge (``rollout/pools.py``) instead of loading it into a local engine:

    sender (trainer rank 0)     {"bucket": metas, crc, index, n}  then the n-byte buffer   per bucket
                                {"end"}                                                   per sync
                                {"stop"}                                                  once, at the end
    every engine owner          WeightReceiver thread: receives each sync whole into a staging slot;
                                the engine loop applies it (``engine.load_buckets``) when its schedule says

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
from collections.abc import Callable, Iterable
from typing import Any

import torch

from megatron_maspo.rollout.buckets import Bucket, meta_from_wire, meta_to_wire

logger = logging.getLogger(__name__)


class WeightSender:
    """What ``sync_weights`` loads into on the training pool's sender: every bucket goes to the engine
    owners over the ``weights`` bridge (the trainer's side of :class:`WeightReceiver`)."""

    def __init__(self, bridge: Any) -> None:
        self.bridge = bridge
        self._version = 0

    @property
    def policy_version(self) -> int:
        """Syncs sent (the engines' load count once they have applied them all)."""
        return self._version

    def load_buckets(self, buckets: Iterable[Bucket], *, verify: bool = True) -> None:
        for b in buckets:
            try:
                self.bridge.broadcast_object({"bucket": [meta_to_wire(m) for m in b.metas], "crc": b.checksum,
                                              "index": b.index, "n": b.buffer.numel(), "verify": verify})
                self.bridge.broadcast(b.buffer, 0)
            finally:
                b.done()
        self.bridge.broadcast_object({"end": True})
        self._version += 1

    def stop(self) -> None:
        """Tell every engine owner that no sync follows (its receiver thread ends)."""
        self.bridge.broadcast_object({"stop": True})


class WeightReceiver:
    """An engine owner's receiving end: a thread takes each sync into one staging slot.

    Args:
        bridge: the ``weights`` bridge (this rank a non-root member); used by this thread only.
        device: where staged buckets live (the engine's device; host memory on CPU).
        staging: where staged buckets live instead, when the engine wants them somewhere particular
            (``engine.staging_pool()``: a vLLM engine's ``ipc`` transport takes shared-memory buffers,
            so each bucket is received straight into memory its workers map; recycled across syncs).
            Its buffers go back to it as the engine finishes each bucket (``Bucket.done``).
    """

    def __init__(self, bridge: Any, *, device: torch.device | str = "cpu", staging: Any = None) -> None:
        self.bridge, self.device, self.staging = bridge, torch.device(device), staging
        self._cond = threading.Condition()
        self._slot: list[Bucket] | None = None
        self._verify = True
        self.stopped = False
        self.error: BaseException | None = None
        self.received = 0
        """Syncs received so far (applied or staged)."""
        self._thread = threading.Thread(target=self._run, name="maspo-weight-receiver", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ receiver thread
    def _run(self) -> None:
        try:
            while True:
                staged: list[Bucket] = []
                while True:
                    msg = self.bridge.broadcast_object(None, 0)
                    if "stop" in msg:
                        with self._cond:
                            self.stopped = True
                            self._cond.notify_all()
                        return
                    if "end" in msg:
                        break
                    release = None
                    if self.staging is not None:  # received in place (the bridge stages NCCL's copy itself)
                        buf, release = self.staging.alloc(msg["n"])
                        self.bridge.broadcast(buf, 0)
                    else:
                        buf = torch.empty(msg["n"], dtype=torch.uint8, device=self.bridge.device)
                        self.bridge.broadcast(buf, 0)
                        if buf.device != self.device:
                            buf = buf.to(self.device)
                    staged.append(Bucket(buf, [meta_from_wire(w) for w in msg["bucket"]], msg["crc"],
                                         msg["index"], release=release))
                    self._verify = bool(msg["verify"])
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
        try:
            engine.load_buckets(slot, verify=self._verify)
        finally:
            for b in slot:  # pooled buffers back to the staging pool (no-op for those the engine released)
                b.done()
        return True

    def wait_for(self, ready: Callable[[], bool], engine: Any, *, timeout_s: float = 1800.0) -> bool:
        """Apply staged syncs one by one until ``ready()``; False when the trainer said stop first.

        Raises:
            RuntimeError: the receiver failed, or nothing arrived for ``timeout_s``.
        """
        while not ready():
            if self.apply_staged(engine):
                continue
            with self._cond:
                idle = self._slot is None and not self.stopped and self.error is None
                if idle and not self._cond.wait(timeout_s) and self._slot is None:
                    raise RuntimeError(f"weight receiver: no weights from the training pool for {timeout_s:.0f} s")
                self._raise_if_failed()
                if self.stopped and self._slot is None:
                    return False
        return True

    def join(self, timeout_s: float = 60.0) -> None:
        self._thread.join(timeout_s)

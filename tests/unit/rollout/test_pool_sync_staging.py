"""WeightReceiver with an engine-provided staging pool (issue 32, vLLM in the rollout pool): each bucket is
received straight into the pool's (shared) buffer, and the buffers go back to the pool once applied."""

from __future__ import annotations

import queue

import pytest
import torch

from megatron_maspo.rollout.buckets import meta_to_wire, pack_buckets
from megatron_maspo.rollout.pool_sync import WeightReceiver
from megatron_maspo.rollout.transport import StagingPool


class _FakeBridge:
    """The receiving end of the ``weights`` bridge, fed from a queue (the sender's messages, in order)."""

    device = torch.device("cpu")
    on_device = False  # a host bridge (comm.Bridge(device=False))

    def __init__(self) -> None:
        self.msgs: queue.Queue = queue.Queue()

    def broadcast_object(self, obj, root=0):
        return self.msgs.get(timeout=30)

    def broadcast(self, t, root=0):
        t.copy_(self.msgs.get(timeout=30))
        return t

    def send_sync(self, buckets) -> None:
        for b in buckets:
            self.msgs.put({"bucket": [meta_to_wire(m) for m in b.metas], "crc": b.checksum, "index": b.index,
                           "n": b.buffer.numel(), "verify": True})
            self.msgs.put(b.buffer.clone())
        self.msgs.put({"end": True})


class _Engine:
    def __init__(self) -> None:
        self.loads: list[list[tuple[bool, bytes]]] = []
        self.policy_version = 0
        self.verify_s, self.verify_full_s = 0.0, None

    def deferred_check(self):
        return None  # verifies nothing (no digests in these syncs)

    def load_buckets(self, buckets, *, verify=True):
        self.loads.append([(b.buffer.is_shared(), bytes(b.buffer.numpy())) for b in buckets])
        self.policy_version += 1


def test_receiver_stages_into_the_engine_pool_and_recycles():
    weights = [("a", torch.arange(40, dtype=torch.float32)), ("b", torch.ones(30, dtype=torch.float32))]
    buckets = list(pack_buckets(weights, 128))
    assert len(buckets) >= 2
    bridge, engine, pool = _FakeBridge(), _Engine(), StagingPool("cpu", shared=True)
    rx = WeightReceiver(bridge, bridge, staging=pool)  # headers and payloads in one queue, in order
    try:
        for v in (1, 2, 3):
            bridge.send_sync(buckets)
            assert rx.wait_for(lambda v=v: engine.policy_version >= v, engine, timeout_s=30)
        assert all(shared for load in engine.loads for shared, _ in load)
        sent = [bytes(b.buffer.numpy()) for b in buckets]
        assert [[data for _, data in load] for load in engine.loads] == [sent] * 3
        assert pool.allocated == len(buckets)  # the first sync's buffers served the next two
    finally:
        bridge.msgs.put({"stop": True})
        rx.join(10)


def test_a_corrupt_bucket_is_refused_before_the_engine_sees_any():
    """The crc32 of every staged bucket is checked when the sync is complete, off the engine loop: a torn
    bucket (here the last one) fails the receiver and no bucket of that sync is loaded."""
    weights = [("a", torch.arange(40, dtype=torch.float32)), ("b", torch.ones(30, dtype=torch.float32))]
    buckets = list(pack_buckets(weights, 128))
    bridge, engine = _FakeBridge(), _Engine()
    rx = WeightReceiver(bridge, bridge)
    try:
        bridge.send_sync(buckets)
        assert rx.wait_for(lambda: engine.policy_version >= 1, engine, timeout_s=30)
        torn = [b.buffer.clone() for b in buckets]
        torn[-1][0] ^= 0xFF
        for b, buf in zip(buckets, torn):
            bridge.msgs.put({"bucket": [meta_to_wire(m) for m in b.metas], "crc": b.checksum, "index": b.index,
                             "n": b.buffer.numel(), "verify": True})
            bridge.msgs.put(buf)
        bridge.msgs.put({"end": True})
        with pytest.raises(RuntimeError, match=f"bucket {buckets[-1].index} arrived corrupted"):
            rx.wait_for(lambda: engine.policy_version >= 2, engine, timeout_s=30)
        assert len(engine.loads) == 1
    finally:
        rx.join(10)

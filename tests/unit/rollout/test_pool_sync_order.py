"""A staged sync that came over several senders' links reaches the engine in the export's global order
(layer by layer), not link by link: vLLM's layer-wise reload holds every tensor of a layer that is not
complete yet on the device, and link j carries EP rank j's experts of every layer (review #4). Split
tensors still reassemble, nothing is copied (runs are views of the staged buffers), and each staged buffer
goes back to its pool only once the engine has loaded every run cut from it."""

from __future__ import annotations

import queue

import torch

from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.rollout.buckets import Bucket, meta_to_wire, pack_buckets, unpack_stream
from megatron_maspo.rollout.transfer_plan import TrainerLayout, build_plan
from megatron_maspo.rollout.transport import StagingPool

MOE = ArchSpec(family="qwen3_moe", num_layers=3, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
               num_query_groups=2, kv_channels=8, vocab_size=97, max_position_embeddings=64, qk_layernorm=True,
               num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2)
BUCKET = 5000  # bytes: the 12 KiB embedding is split over three buckets, experts go four to a bucket


class _Link:
    """One sender's link as an owner sees it (headers and payloads from a queue, in order)."""

    device = torch.device("cpu")
    on_device = False

    def __init__(self) -> None:
        self.msgs: queue.Queue = queue.Queue()

    def broadcast_object(self, obj, root=0):
        return self.msgs.get(timeout=30)

    def broadcast(self, t, root=0):
        t.copy_(self.msgs.get(timeout=30))
        return t

    def send_sync(self, buckets: list[Bucket]) -> None:
        for b in buckets:
            self.msgs.put({"bucket": [meta_to_wire(m) for m in b.metas], "crc": b.checksum, "index": b.index,
                           "n": b.buffer.numel(), "verify": True})
            self.msgs.put(b.buffer.clone())
        self.msgs.put({"end": True})


class _RecordingEngine:
    """Records the buckets it is handed and the tensors they unpack to, in order."""

    def __init__(self) -> None:
        self.policy_version, self.verify_s, self.verify_full_s = 0, 0.0, None
        self.buckets: list[Bucket] = []
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.free_during_load: list[int] = []

    def deferred_check(self):
        return None

    def load_buckets(self, buckets, *, verify=True):
        self.buckets = list(buckets)
        self.tensors = [(n, t.clone()) for n, t in unpack_stream(self.buckets, verify=verify)]
        self.policy_version += 1


def _sync(seed: int):
    """The plan of MOE at EP 2 (two senders: each EP rank's experts over its own link) and every tensor."""
    from megatron_maspo.conversion.plan import hf_shape

    plan = build_plan(MOE, TrainerLayout(ep=2, dp=2), engines=(2,), dtype="float32")
    assert plan.senders == (0, 1)
    g = torch.Generator().manual_seed(seed)
    weights = {s.name: torch.randn(hf_shape(s.name, MOE), generator=g) for s in plan.sends}
    return plan, weights


def _receiver(links, order, staging):
    from megatron_maspo.rollout.pool_sync import WeightReceiver

    (lead, *more) = links
    return WeightReceiver(lead, lead, more=[(m, m) for m in more], order=order, staging=staging)


def test_a_two_link_moe_sync_reaches_the_engine_in_export_order():
    plan, weights = _sync(0)
    order = [s.name for s in plan.sends]
    links = [_Link(), _Link()]
    staging = StagingPool("cpu")
    rx = _receiver(links, order, staging)
    engine = _RecordingEngine()
    try:
        for v in (1, 2):
            per_link = []
            for rank in plan.senders[:len(links)]:
                mine = [(s.name, weights[s.name] * v) for s in plan.for_rank(rank)]
                per_link.append(list(pack_buckets(mine, BUCKET)))
                assert any(m.part is not None for b in per_link[-1] for m in b.metas) or rank == 1
            for link, buckets in zip(reversed(links), reversed(per_link)):  # link 1 finishes first
                link.send_sync(buckets)
            assert rx.wait_for(lambda v=v: engine.policy_version >= v, engine, timeout_s=30)
            assert [n for n, _ in engine.tensors] == order  # layer by layer, each layer's experts whole
            for n, t in engine.tensors:
                assert torch.equal(t, weights[n] * v), n
            # runs are views into the staged buffers (no copy), and fewer than one per tensor
            assert len(engine.buckets) < len(order)
            staged = sum(len(b) for b in per_link)
            assert staging.allocated == staged  # sync 2 reused sync 1's buffers: all went back
    finally:
        for link in links:
            link.msgs.put({"stop": True})
        rx.join(10)


def test_one_link_keeps_its_buckets_as_sent():
    plan, weights = _sync(1)
    link, engine = _Link(), _RecordingEngine()
    rx = _receiver([link], [s.name for s in plan.sends], None)
    try:
        buckets = list(pack_buckets(((s.name, weights[s.name]) for s in plan.sends), BUCKET))
        link.send_sync(buckets)
        assert rx.wait_for(lambda: engine.policy_version >= 1, engine, timeout_s=30)
        assert [b.index for b in engine.buckets] == [b.index for b in buckets]
        assert [n for n, _ in engine.tensors] == [s.name for s in plan.sends]
    finally:
        link.msgs.put({"stop": True})
        rx.join(10)

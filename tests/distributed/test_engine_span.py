"""Engines larger than a node (issue 56): the rendezvous that gives each node leader the owner's address and
port, and the relay that brings a bucket mapped on the owner's node to the workers of the other nodes.

Both run on real gloo worlds: the rendezvous over the default group (an object all-gather, as the trainer
and the rollout pool call it), the relay over a group standing in for the engine's TP group (vLLM's device
group is the same ``torch.distributed.broadcast``; NCCL across nodes on GPUs, gloo here).
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

from megatron_maspo.rollout.engine_span import EngineSpan, any_spans, host_address, rendezvous, role
from megatron_maspo.rollout.fleet import FleetLayout, place_engine
from megatron_maspo.rollout.transport import relay_bucket
from tests.distributed._launch import free_port, run_workers


def _rendezvous(rank: int, world: int) -> EngineSpan | None:
    from megatron_maspo.parallel import comm

    placements = FleetLayout(world=world, rollout_tp=2).placement(1)  # nodes of one GPU: each engine spans 2
    return rendezvous(placements, rank, all_gather=comm.all_gather_object, free_port=free_port)


def test_every_node_leader_learns_its_owners_address_and_port():
    spans = run_workers(_rendezvous, 4)
    assert [(s.engine, s.node_rank, s.nnodes) for s in spans] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert spans[0].master_port == spans[1].master_port != spans[2].master_port == spans[3].master_port
    assert {s.master_addr for s in spans} == {host_address()}
    assert spans[0].vllm_kwargs() == dict(distributed_executor_backend="mp", nnodes=2, node_rank=0,
                                          master_addr=spans[0].master_addr, master_port=spans[0].master_port)


def test_roles_only_for_leaders_of_spanning_engines():
    inside = FleetLayout(world=16, rollout_tp=8).placement(8)
    assert not any_spans(inside) and role(inside, 0) is None
    spanning = FleetLayout(world=32, rollout_tp=16).placement(8)
    assert any_spans(spanning)
    assert [(role(spanning, r) or (None, None))[1] for r in (0, 8, 9, 16, 24)] == [0, 1, None, 0, 1]
    with pytest.raises(ValueError, match="node_rank 2 of 2"):
        EngineSpan(engine=0, nnodes=2, node_rank=2, master_addr="h", master_port=1)


def test_the_owners_missing_offer_is_named():
    placements = (place_engine(0, 0, 2, 1),)
    with pytest.raises(RuntimeError, match="owner \\(rank 0\\) offered no address"):
        rendezvous(placements, 1, all_gather=lambda mine: [mine], free_port=free_port)


def _relay(rank: int, world: int, payload: bytes) -> tuple[int, int]:
    from megatron_maspo.rollout.transport import open_shared, share

    group = dist.new_group(list(range(world)), backend="gloo")
    nbytes = len(payload)
    mapped = None
    if rank == 0:  # the first worker maps the owner's shared buffer; nobody else can
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        mapped = open_shared(share(buf))
    got = relay_bucket(mapped, nbytes, torch.device("cpu"),
                       lambda t: dist.broadcast(t, src=0, group=group))
    return got.numel(), zlib.crc32(got.numpy())


def test_a_bucket_mapped_on_the_first_node_reaches_every_worker_bitwise():
    payload = bytes(torch.randint(0, 256, (300_001,), dtype=torch.uint8).tolist())
    got = run_workers(_relay, 3, payload)
    assert got == [(len(payload), zlib.crc32(payload))] * 3


def test_only_an_engine_with_node_workers_may_span_nodes():
    import importlib
    from types import SimpleNamespace

    from megatron_maspo.rollout import engines

    module, cls = engines.traits("vllm").node_cls.split(":")
    assert hasattr(getattr(importlib.import_module(module), cls), "from_settings")
    node1 = EngineSpan(engine=0, nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=1234)
    with pytest.raises(ValueError, match="rollout.engine='builtin' cannot span nodes"):
        engines.build_engine(SimpleNamespace(engine="builtin"), None, None, seed=0, deterministic=True, span=node1)

"""Only the sender's model-parallel replica runs the export collectives (DP replicas skip them)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed._launch import run_workers


def _worker(rank: int, world: int) -> tuple:
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.rollout.weight_sync import joins_export, sync_weights

    out = []
    for tp, ep in ((2, 1), (1, 1), (4, 1), (1, 2)):
        g = init_parallel(tp=tp, ep=ep)
        out.append((tp, ep, g.dp_rank, joins_export(g, 0), joins_export(g, world - 1)))
    g = init_parallel(tp=2)
    if not joins_export(g, 0):
        # returns before touching the model, the engine or any collective
        stats = sync_weights(None, None, g, None, bucket_bytes=1)
        assert stats.num_bytes == stats.num_tensors == 0
    dist.barrier()
    return tuple(out)


@pytest.mark.slow  # ~40-50 s on 2 cores; the fleet test below keeps replica feeding in the default run
def test_dp_replicas_skip_the_export():
    res = run_workers(_worker, 4)
    for rank, rows in enumerate(res):
        for tp, ep, dp_rank, to_first, to_last in rows:
            if ep > 1 or tp == 4:  # EP gathers span DP; tp 4 is one replica
                assert to_first and to_last, (rank, tp, ep)
            else:  # TP-fastest order: rank // tp is the replica
                assert dp_rank == rank // tp, (rank, tp, dp_rank)
                assert to_first == (rank // tp == 0), (rank, tp)
                assert to_last == (rank // tp == (4 - 1) // tp), (rank, tp)


def _fleet_worker(rank: int, world: int) -> dict:
    from megatron_maspo.conversion.megatron_to_hf import export_hf_weights
    from megatron_maspo.model.hf_config import hf_config_dict
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine
    from megatron_maspo.rollout.fleet import FleetLayout
    from megatron_maspo.rollout.weight_sync import joins_export, sync_weights
    from tests.distributed._gpt_helpers import build
    from tests.distributed.test_weight_sync import BUCKET, SPEC

    agree = []
    for tp in (1, 2, 4):
        g = init_parallel(tp=tp)
        for rtp in (1, 2, 4):
            f = FleetLayout(world=world, rollout_tp=rtp, tp=tp)
            agree.append(joins_export(g, f.engine_ranks) == f.joins_export(rank))
    # TP 2 x DP 2 with an engine on every rank: each replica exports once, both of its owners load it
    fleet = FleetLayout(world=world, rollout_tp=1, tp=2)
    groups, chunks = build(SPEC, 2, 1, divisible_by=64)
    engine = BuiltinEngine.from_hf_config(hf_config_dict(SPEC))
    stats = sync_weights(chunks, SPEC, groups, engine, bucket_bytes=BUCKET, sender_rank=fleet.engine_ranks)
    want = dict(export_hf_weights(chunks, SPEC, groups))
    got = dict(engine.model.named_parameters())
    return {"agree": all(agree), "synced": stats.num_tensors == len(want) > 0,
            "equal": all(bool((got[n] == t).all()) for n, t in want.items())}


def test_every_engine_of_a_fleet_is_fed_by_its_replica():
    for rank, res in enumerate(run_workers(_fleet_worker, 4)):
        assert res == {"agree": True, "synced": True, "equal": True}, rank

"""Only the senders' model-parallel (TP x PP) groups run the export collectives (DP replicas and CP ranks
without an owner skip them)."""

from __future__ import annotations

import pytest
import torch
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


def _cp_worker(rank: int, world: int) -> dict:
    """TP 2 x CP 2 (one replica over 4 ranks) against TP 2 x DP 2: the same engine weights, bit for bit,
    with each owner's TP x PP group exporting once and the other CP half skipping when it feeds nobody."""
    import megatron_maspo.rollout.weight_sync as ws
    from megatron_maspo.conversion.megatron_to_hf import export_hf_weights
    from megatron_maspo.model.hf_config import hf_config_dict
    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine
    from megatron_maspo.rollout.fleet import FleetLayout
    from tests.distributed._actor_helpers import name_init
    from tests.distributed.test_weight_sync import BUCKET, SPEC

    def chunks_at(cp: int):
        groups = init_parallel(tp=2, cp=cp, seed=7)
        chunks = build_model_chunks(SPEC, ModelBuildOptions(tp=2, cp=cp, make_vocab_size_divisible_by=64),
                                    pp_rank=groups.pp_rank)
        name_init(SPEC, groups, 7)(chunks)
        return groups, chunks

    g1, c1 = chunks_at(1)  # the cp = 1 sync: an engine on every rank (each TP group exports once)
    ref = BuiltinEngine.from_hf_config(hf_config_dict(SPEC))
    owners1 = FleetLayout(world=world, rollout_tp=1, tp=2).engine_ranks
    ws.sync_weights(c1, SPEC, g1, ref, bucket_bytes=BUCKET, sender_rank=owners1)
    want = {n: t.clone() for n, t in ref.model.named_parameters()}
    assert want.keys() == dict(export_hf_weights(c1, SPEC, g1)).keys()

    g2, c2 = chunks_at(2)
    exports = []
    orig = ws.export_hf_weights

    def counted(*a, **k):
        exports.append(1)
        return orig(*a, **k)

    ws.export_hf_weights = counted
    out: dict = {"cp_rank": g2.cp_rank, "dp": g2.dp}
    try:
        for rtp in (1, 2, 4):
            fleet = FleetLayout(world=world, rollout_tp=rtp, tp=2, cp=2)
            engine = BuiltinEngine.from_hf_config(hf_config_dict(SPEC)) if rank in fleet.engine_ranks else None
            exports.clear()
            stats = ws.sync_weights(c2, SPEC, g2, engine, bucket_bytes=BUCKET, sender_rank=fleet.engine_ranks)
            equal = None
            if engine is not None:
                got = dict(engine.model.named_parameters())
                equal = stats.num_tensors == len(want) and all(torch.equal(got[n], t) for n, t in want.items())
            out[rtp] = {"exports": len(exports), "fleet_agrees": fleet.joins_export(rank) == bool(exports),
                        "equal": equal}
    finally:
        ws.export_hf_weights = orig
    dist.barrier()
    return out


@pytest.mark.slow  # ~45 s idle, ~100 s on 2 loaded cores (4 ranks); tests/unit/rollout/test_fleet.py keeps the rule
def test_cp_sync_exports_once_per_owner_group_and_matches_cp1():
    for rank, res in enumerate(run_workers(_cp_worker, 4)):
        assert res["cp_rank"] == rank // 2 and res["dp"] == 1, res
        for rtp, joined in ((1, True), (2, True), (4, rank < 2)):  # rollout TP 4: one engine on rank 0
            r = res[rtp]
            assert r["exports"] == int(joined) and r["fleet_agrees"], (rank, rtp, r)
            assert r["equal"] is (True if rank % rtp == 0 else None), (rank, rtp, r)

"""The fleet layout: engine owners, prompt shards, feeding replicas."""

from __future__ import annotations

import pytest

from megatron_maspo.config import MaspoConfig
from megatron_maspo.rollout.fleet import FleetLayout, build_fleet


def test_one_engine_per_rank_with_builtin_dp2():
    f = FleetLayout(world=2, rollout_tp=1)
    assert f.num_engines == 2 and f.engine_ranks == (0, 1)
    assert [list(f.shard(8, e)) for e in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert f.feeding_replica(0) == 0 and f.feeding_replica(1) == 1
    assert f.joins_export(0) and f.joins_export(1)


@pytest.mark.parametrize("P,E", [(0, 3), (1, 3), (7, 3), (8, 4), (5, 8), (33, 4)])
def test_shards_are_contiguous_balanced_and_cover(P, E):
    f = FleetLayout(world=E, rollout_tp=1)
    covered = [i for e in range(E) for i in f.shard(P, e)]
    assert covered == list(range(P))
    sizes = f.shard_sizes(P)
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_vllm_tp_groups_and_replicas():
    # 32 ranks, TP 4 x PP 2 trainer (dp 4), vLLM TP 8: 4 engines on ranks 0, 8, 16, 24
    f = FleetLayout(world=32, rollout_tp=8, tp=4, pp=2)
    assert f.num_engines == 4 and f.engine_ranks == (0, 8, 16, 24)
    assert f.engine_of(8) == 1 and f.engine_of(9) is None
    # rank = tp_rank + tp*dp_rank + tp*dp*pp_rank: ranks 0 and 16 are dp 0 (16 = stage 1 of replica 0)
    assert [f.feeding_replica(e) for e in range(4)] == [0, 2, 0, 2]
    assert f.joins_export(4) is False  # replica 1 feeds nobody
    assert f.joins_export(5 + 16) is False and f.joins_export(1) is True


def test_one_engine_for_a_whole_world_skips_other_replicas():
    f = FleetLayout(world=8, rollout_tp=8)
    assert f.num_engines == 1 and f.joins_export(0) and not f.joins_export(3)
    assert FleetLayout(world=8, rollout_tp=8, ep=2).joins_export(3)  # EP: every rank gathers experts


def test_bad_layouts_raise():
    with pytest.raises(ValueError, match="does not divide"):
        FleetLayout(world=6, rollout_tp=4)
    with pytest.raises(ValueError, match="outside"):
        FleetLayout(world=2, rollout_tp=1).engine_of(2)


def test_build_from_config_uses_vllm_tp_only_for_vllm():
    cfg = MaspoConfig()
    cfg.rollout.vllm_tp = 2
    assert build_fleet(cfg.parallel, cfg.rollout, world=4).num_engines == 4  # built-in: one device per engine
    cfg.rollout.engine = "vllm"
    assert build_fleet(cfg.parallel, cfg.rollout, world=4).num_engines == 2


def test_cp_ranks_without_an_owner_skip_the_export():
    # TP 2 x CP 2 on 4 ranks (dp 1): ranks 0, 1 are cp 0 and 2, 3 cp 1; both CP halves hold one replica
    f = FleetLayout(world=4, rollout_tp=4, tp=2, cp=2)
    assert [f.export_group_of(r) for r in range(4)] == [0, 0, 1, 1] and f.feeding_replica(0) == 0
    assert [f.joins_export(r) for r in range(4)] == [True, True, False, False]  # one engine: cp 0 exports
    f = FleetLayout(world=4, rollout_tp=2, tp=2, cp=2)  # owners 0 (cp 0) and 2 (cp 1): each exports its own
    assert all(f.joins_export(r) for r in range(4))
    # CP 2 x DP 2 (tp 1), engines on ranks 0 and 2: cp 0 of each replica
    f = FleetLayout(world=4, rollout_tp=2, cp=2)
    assert [f.export_group_of(r) for r in range(4)] == [0, 1, 2, 3]
    assert [f.feeding_replica(e) for e in range(2)] == [0, 1]
    assert [f.joins_export(r) for r in range(4)] == [True, False, True, False]
    assert FleetLayout(world=4, rollout_tp=4, cp=2, ep=2).joins_export(3)  # EP: every rank gathers experts

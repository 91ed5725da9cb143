"""``maspo check``'s weight-links line: the communicators each rank joins between the pools and their NCCL
buffers, counted from ``PoolLayout.bridge_comms`` (the list the job builds its bridges from), against
``rollout.weight_link_nccl_budget_mb``."""

from __future__ import annotations

import pytest

from megatron_maspo.check.pools import check_weight_links
from megatron_maspo.check.steps import CheckError
from megatron_maspo.parallel.group_plan import PARENT, PAYLOAD, plan_groups
from megatron_maspo.parallel.link_budget import MIB, broadcast_peers, nccl_channel_bytes, rank_costs
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.rollout.pools import PoolLayout

QWEN3_235B = dict(world=256, engine_ranks=64, rollout_tp=8, tp=4, pp=2, ep=32, moe=True)
DEEPSEEK_V3 = dict(world=512, engine_ranks=256, rollout_tp=8, tp=8, ep=256, moe=True)


def test_one_channel_costs_two_ring_connections_of_three_protocol_buffers():
    assert nccl_channel_bytes() == 2 * (4 * MIB + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16)
    assert round(nccl_channel_bytes() / MIB, 1) == 18.4


def test_gloo_broadcast_peers_follow_a_binomial_tree():
    # round i pairs v with v + 2^i (low bit first): 0 -> 1; 0 -> 2, 1 -> 3; 0 -> 4, 1 -> 5, 2 -> 6, 3 -> 7
    assert [broadcast_peers(i, 8) for i in range(8)] == [3, 3, 2, 2, 1, 1, 1, 1]
    assert broadcast_peers(0, 8) == 3 and broadcast_peers(0, 9) == 4 and broadcast_peers(0, 1) == 0
    # every member but the root has exactly one parent: the peers sum to twice the tree's edges
    for n in (2, 5, 8, 33):
        assert sum(broadcast_peers(i, n) for i in range(n)) == 2 * (n - 1)


def test_the_owner_joins_one_payload_communicator_per_link_split_from_one_parent():
    pools = PoolLayout(**QWEN3_235B, max_links=1000)  # one link per sender
    plans = plan_groups(pools, 8)
    assert sum(p.role == PARENT for p in plans) == 1
    senders = len(pools.sender_ranks)
    costs = rank_costs(plans, channels=2)
    owner = costs[pools.owner_ranks[0]]
    assert (owner.links, owner.nccl) == (senders, senders + 1)  # + the parent, which holds no buffers
    assert owner.nccl_bytes == senders * 2 * nccl_channel_bytes()
    assert costs[pools.sender_ranks[-1]].links == 1
    assert all(p.backend == "nccl" for p in plans if p.role == PAYLOAD)


def test_the_check_prints_the_busiest_rank_and_fails_past_the_budget():
    pools = PoolLayout(**QWEN3_235B, max_links=1000)
    line = check_weight_links(pools, RolloutConfig(placement="disaggregated", engine_ranks=64), 8)
    assert line.startswith("ok   weight links: 66 link(s) for 66 sender(s)") and "2,426 MiB of NCCL buffers" in line
    tight = RolloutConfig(placement="disaggregated", engine_ranks=64, weight_link_nccl_budget_mb=1000)
    with pytest.raises(CheckError, match="an engine owner.*> rollout.weight_link_nccl_budget_mb=1000.*max_weight_links"):
        check_weight_links(pools, tight, 8)
    one = RolloutConfig(placement="disaggregated", engine_ranks=64, weight_link_channels=1,
                        weight_link_nccl_budget_mb=1300)
    assert "1,213 MiB" in check_weight_links(pools, one, 8)


def test_deepseek_v3_disaggregated_fits_the_budget_once_senders_share_sixteen_links():
    # the recipe's shape split 256 + 256: 256 senders (rank 0's dense TP group holds 8 of them)
    cfg = RolloutConfig(placement="disaggregated", engine_ranks=256, vllm_tp=8)
    one_each = PoolLayout(**DEEPSEEK_V3, max_links=1000)
    with pytest.raises(CheckError, match=r"9,408 MiB of NCCL buffers \(256 payload"):
        check_weight_links(one_each, cfg, 8)
    line = check_weight_links(PoolLayout(**DEEPSEEK_V3), cfg, 8)
    assert "16 link(s) for 256 sender(s)" in line and "up to 16 senders taking turns" in line, line
    assert "at most 17 communicator(s) on a rank" in line and "588 MiB of NCCL buffers" in line, line


@pytest.mark.parametrize("nodes", [16, 32, 64, 128])
def test_an_owners_communicators_stay_bounded_as_the_job_grows(nodes):
    world = nodes * 8
    pools = PoolLayout(world=world, engine_ranks=world // 2, rollout_tp=8, tp=8, ep=min(256, world // 2), moe=True)
    costs = rank_costs(plan_groups(pools, 8), channels=2)
    assert len(pools.sender_ranks) > 16
    assert max(c.nccl for c in costs.values()) <= 17  # 16 links + their parent, at any size
    assert max(c.links for c in costs.values()) <= 16


def test_senders_share_links_in_rank_order_and_no_link_holds_two_of_a_dense_tp_group():
    pools = PoolLayout(**DEEPSEEK_V3)
    groups = pools.sender_groups
    assert sorted(r for g in groups for r in g) == list(pools.sender_ranks)  # each sender on one link
    assert groups[0][0] == 0 and all(list(g) == sorted(g) for g in groups)  # rank 0 leads; turns ascend
    for g in groups:  # ranks 0-7: the dense sender's TP group (8 senders: expert-DP is 1)
        assert sum(r < 8 for r in g) <= 1
    links = pools.weight_links
    assert [link.senders for link in links] == [len(g) for g in groups]
    assert links[0].name == "weights" and links[0].ranks[:links[0].senders] == groups[0]
    # a TP 2 x EP 2 stage without expert replicas: EP rank 1 is the dense sender's TP peer
    with pytest.raises(ValueError, match="max_weight_links=1 is below the 2 senders of the TP group at rank 0"):
        PoolLayout(world=4, engine_ranks=2, tp=2, ep=2, moe=True, max_links=1)
    assert PoolLayout(world=6, engine_ranks=2, tp=2, ep=2, moe=True, max_links=1).sender_groups == ((0, 2, 3),)


def test_a_shared_header_group_counts_the_sockets_of_every_senders_tree():
    pools = PoolLayout(world=8, engine_ranks=4, pp=4, max_links=1)  # 4 stage senders, 4 owners, one link
    (link,) = pools.weight_links
    assert link.senders == 4 and link.ranks == (0, 1, 2, 3, 4, 5, 6, 7)
    costs = rank_costs(plan_groups(pools, 8), channels=2)
    # owner 1 (member 5, in no other host group): its parent in the tree from root 0 is member 1; from roots
    # 2 and 3 it also serves member 3 (virtual ranks 3 -> 1 and 2 -> 0 in the shifted trees)
    assert costs[5].gloo == 1 and costs[5].gloo_sockets == 1 + 2

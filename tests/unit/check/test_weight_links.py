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


def test_the_owner_joins_one_payload_communicator_per_sender_split_from_one_parent():
    pools = PoolLayout(**QWEN3_235B)
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
    pools = PoolLayout(**QWEN3_235B)
    line = check_weight_links(pools, RolloutConfig(placement="disaggregated", engine_ranks=64), 8)
    assert line.startswith("ok   weight links: 66 link(s)") and "2,426 MiB of NCCL buffers" in line
    tight = RolloutConfig(placement="disaggregated", engine_ranks=64, weight_link_nccl_budget_mb=1000)
    with pytest.raises(CheckError, match="an engine owner.*> rollout.weight_link_nccl_budget_mb=1000"):
        check_weight_links(pools, tight, 8)
    one = RolloutConfig(placement="disaggregated", engine_ranks=64, weight_link_channels=1,
                        weight_link_nccl_budget_mb=1300)
    assert "1,213 MiB" in check_weight_links(pools, one, 8)

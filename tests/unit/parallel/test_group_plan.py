"""The GPU-backend rule (``parallel/group_plan.py``): device groups are NCCL whatever their size, host-only
groups gloo, a weights bridge whose members share a GPU stages on the host, and a device group that would
be gloo is refused in one line naming it and its ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_maspo.parallel.group_plan import (
    GLOO,
    NCCL,
    GroupPlan,
    GroupPlanError,
    format_ranks,
    gpu_backend,
    gpu_of,
    members_share_a_gpu,
    plan_groups,
    validate,
)
from megatron_maspo.rollout.pools import PoolLayout


def test_the_rule_table():
    assert gpu_backend(carries_device=True, members_share_a_gpu=False) == NCCL
    assert gpu_backend(carries_device=False, members_share_a_gpu=False) == GLOO
    assert gpu_backend(carries_device=False, members_share_a_gpu=True) == GLOO
    assert gpu_backend(carries_device=True, members_share_a_gpu=True) == GLOO  # refused by validate


def test_four_nodes_16_training_and_16_rollout_ranks():
    """docs/disaggregated.md's example: both pools are larger than one 8-GPU node and stay NCCL (bug B:
    ``comm.default_backend(16)`` said gloo there)."""
    by = {p.name: p for p in plan_groups(PoolLayout(world=32, engine_ranks=16, tp=2), 8)}
    assert list(by) == ["train", "rollout", "weights", "weights_ctl", "batches"]
    assert by["weights_ctl"].ranks == by["weights"].ranks and by["weights_ctl"].backend == GLOO
    assert by["train"].ranks == tuple(range(16)) and by["train"].backend == NCCL and by["train"].carries_device
    assert by["rollout"].ranks == tuple(range(16, 32)) and by["rollout"].backend == NCCL
    assert by["weights"].ranks == (0, *range(16, 32)) and by["weights"].backend == NCCL
    assert by["batches"].ranks == (16, *range(16)) and by["batches"].backend == GLOO
    assert not by["batches"].carries_device and "host-only" in by["batches"].why
    validate(list(by.values()))


@pytest.mark.parametrize("gpus_per_node", [1, 2, 8])
def test_a_pool_larger_than_one_node_is_still_nccl(gpus_per_node):
    colocated, = plan_groups(64, gpus_per_node)
    assert (colocated.name, colocated.backend, len(colocated.ranks)) == ("world", NCCL, 64)
    train, rollout, *_ = plan_groups(PoolLayout(world=48, engine_ranks=8), gpus_per_node)
    assert train.backend == rollout.backend == NCCL and not train.shares_gpu


def test_vllm_tp_engines_owners_in_the_weights_bridge():
    groups = plan_groups(PoolLayout(world=16, engine_ranks=8, rollout_tp=4), 8)
    weights = next(p for p in groups if p.name == "weights")
    assert weights.ranks == (0, 8, 12) and weights.backend == NCCL


def test_one_gpu_two_processes_the_weights_bridge_stages_on_the_host():
    """The smoke machine: a one-rank training pool and a one-rank rollout pool on GPU 0."""
    assert gpu_of(0, 1, ranks_per_node=2) == gpu_of(1, 1, ranks_per_node=2) == (0, 0)
    assert members_share_a_gpu((0, 1), 1, ranks_per_node=2) and not members_share_a_gpu((0, 8), 8)
    by = {p.name: p for p in plan_groups(PoolLayout(world=2, engine_ranks=1), 1, ranks_per_node=2)}
    assert by["weights"].backend == GLOO and by["weights"].shares_gpu and not by["weights"].carries_device
    assert "staged on the host" in by["weights"].why
    assert by["train"].backend == by["rollout"].backend == NCCL  # one rank each: nothing shared
    validate(list(by.values()))


def test_two_ranks_of_one_pool_on_one_gpu_are_refused_in_one_line():
    groups = plan_groups(PoolLayout(world=4, engine_ranks=2), 1, ranks_per_node=4)
    with pytest.raises(GroupPlanError) as e:
        validate(groups)
    msg = str(e.value)
    assert "\n" not in msg and "'train' (ranks 0-1)" in msg and "share a GPU" in msg


def test_a_planted_gloo_device_group_fails():
    planted = GroupPlan("train", tuple(range(16)), carries_device=True, backend=GLOO)
    with pytest.raises(GroupPlanError, match=r"'train' \(ranks 0-15\) carries device tensors but would be gloo"):
        validate([planted])


def test_format_ranks_runs():
    assert format_ranks((3,)) == "rank 3"
    assert format_ranks((0, 16, 17, 18)) == "ranks 0, 16-18"
    assert format_ranks((0, 2, 4, 6, 8, 10)) == "ranks 0, 2, 4, 6, ... (6 ranks)"


def test_module_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import megatron_maspo.parallel.group_plan as g; print(g.gpu_backend(True, False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == NCCL, out.stderr

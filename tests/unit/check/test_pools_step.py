"""``maspo check``'s ``process groups`` and ``host shared memory`` steps: the 4-node disaggregated 7B job
names nccl for both pools, a planted gloo device group fails the step, and the vLLM staging's
``/dev/shm`` per node is printed and held to a node size when one is given."""

from __future__ import annotations

import pytest

from megatron_maspo.check.pools import check_process_groups, shm_line
from megatron_maspo.check.run import check_config
from megatron_maspo.check.steps import CheckError
from megatron_maspo.parallel.group_plan import GLOO, GroupPlan, plan_groups
from megatron_maspo.recipes.registry import resolve_config
from megatron_maspo.rollout.pools import PoolLayout

DISAGG = ["rollout.placement=disaggregated", "rollout.engine_ranks=16", "rollout.max_staleness=1",
          "loss.tis_cap=2.0"]


def test_the_issue_command_names_nccl_for_both_pools(capsys):
    from megatron_maspo.cli.main import main

    argv = ["check", "r1_distill_qwen_7b_maspo", "--nodes", "4"]
    assert main(argv + [x for s in DISAGG for x in ("--set", s)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ok   process groups:"))
    assert "train pool (ranks 0-15) nccl" in line and "rollout pool (ranks 16-31) nccl" in line
    assert "weights (ranks 0, 16-31) nccl" in line and "batches (ranks 16, 0-15) gloo [pickled" in line


def test_a_planted_gloo_device_group_fails_the_step():
    plans = list(plan_groups(PoolLayout(world=32, engine_ranks=16, tp=2), 8))
    assert check_process_groups(plans).startswith("ok   process groups:")
    plans[1] = GroupPlan("rollout", plans[1].ranks, carries_device=True, backend=GLOO)  # bug B's choice
    with pytest.raises(CheckError, match=r"\[process groups\] process group 'rollout' \(ranks 16-31\) carries "
                                         "device tensors but would be gloo"):
        check_process_groups(plans)


def test_colocated_has_one_world_group():
    line = check_process_groups(plan_groups(32, 8))
    assert "world pool (ranks 0-31) nccl (colocated: no bridges)" in line


def _rollout(**kw):
    sets = [f"rollout.{k}={v}" for k, v in kw.items()]
    cfg = resolve_config("tiny", None, [*sets, "parallel.world_size=2", "rollout.max_staleness=1", "loss.tis_cap=2.0"])
    return cfg.rollout


def test_shm_line_counts_two_syncs_per_engine_owner_on_the_busiest_node():
    ro = _rollout(placement="disaggregated", engine="vllm", engine_ranks=1)
    gib = 2**30
    line = shm_line(ro, 3 * gib, [2, 2, 3], "bfloat16")
    assert line.startswith("ok   host shared memory: 12.0 GiB of /dev/shm per node (node 2: 2 vLLM")
    assert "--ipc=host" in line and "--shm-size=14g" in line
    assert shm_line(ro, 3 * gib, [2, 2, 3], "bfloat16", node_shm_gb=12.0).startswith("ok")
    with pytest.raises(CheckError, match=r"\[host shared memory\] 12.0 GiB .* > the node's 8 GiB: run the container"):
        shm_line(ro, 3 * gib, [2, 2, 3], "bfloat16", node_shm_gb=8.0)
    # nothing staged in shared memory: built-in engine, the bytes transport, colocated
    for other in (_rollout(placement="disaggregated", engine="builtin", engine_ranks=1),
                  _rollout(placement="disaggregated", engine="vllm", weight_transport="bytes", engine_ranks=1),
                  _rollout(engine="vllm")):
        assert "not used" in shm_line(other, 3 * gib, [0], "bfloat16", node_shm_gb=0.001)


def test_check_holds_the_7b_staging_to_the_node_size_given():
    cfg = resolve_config("r1_distill_qwen_7b_maspo", None, [*DISAGG, "rollout.engine=vllm"])
    res = check_config(cfg, nodes=4, gpus_per_node=8, node_shm_gb=64.0)
    assert res.error is not None and res.error.step == "host shared memory", res.lines
    assert "8 vLLM engine owner(s) x 2 syncs x 14.2 GiB bfloat16" in str(res.error)

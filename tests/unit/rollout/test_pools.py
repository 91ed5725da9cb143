"""Disaggregated placement as data: which ranks train, which generate, who talks to whom, and the config
checks that refuse what the placement cannot do."""

from __future__ import annotations

import pytest

from megatron_maspo.config import check_combinations
from megatron_maspo.recipes.registry import resolve_config
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.rollout.pools import ROLLOUT, TRAIN, PoolLayout
from megatron_maspo.train.rollouts.pool import needed_version


def test_two_nodes_of_eight_six_trainers_and_five_engines_of_tp2_would_not_divide():
    with pytest.raises(ValueError, match="engine TP 2 does not divide"):
        PoolLayout(world=16, engine_ranks=5, rollout_tp=2)
    with pytest.raises(ValueError, match="not a multiple of tp\\*pp\\*cp=4"):
        PoolLayout(world=16, engine_ranks=6, tp=4)
    with pytest.raises(ValueError, match="at least one"):
        PoolLayout(world=2, engine_ranks=2)


def test_layout_of_a_16_gpu_job_with_a_4_gpu_rollout_pool():
    lay = PoolLayout(world=16, engine_ranks=4, rollout_tp=2, tp=4)
    assert (lay.trainer_world, lay.dp, lay.num_engines) == (12, 3, 2)
    assert [lay.role(r) for r in (0, 11, 12, 15)] == [TRAIN, TRAIN, ROLLOUT, ROLLOUT]
    assert [lay.pool_rank(r) for r in (0, 11, 12, 15)] == [0, 11, 0, 3]
    assert lay.owner_ranks == (12, 14)
    assert lay.weights_ranks == (0, 12, 14) and lay.batches_ranks == (12, *range(12))
    # node 1 (ranks 8-15): the engines on its GPUs 4-5 and 6-7, nothing shared
    assert [(p.owner, p.node, p.gpus) for p in lay.placement(8)] == [(12, 1, (4, 5)), (14, 1, (6, 7))]
    assert "ranks 0-11 train; 2 engine(s) of rollout TP 2 on ranks 12-15" in lay.describe(32)


def test_the_schedule_versions_match_the_colocated_loop():
    # k = 2: steps 0..2 by the initial weights (version 1), then one version per step
    assert [needed_version(t, 2) for t in range(6)] == [1, 1, 1, 2, 3, 4]
    assert [needed_version(t, 0) for t in range(3)] == [1, 2, 3]


@pytest.mark.parametrize("sets, fragment", [
    (["rollout.placement=disaggregated"], "engine_ranks >= 1"),
    (["rollout.engine_ranks=1"], "apply only to rollout.placement=disaggregated"),
    (["rollout.in_flight_chunk_tokens=-1"], "must be >= 0"),
    (["rollout.placement=nowhere"], "accepted"),
])
def test_rollout_section_refuses(sets, fragment):
    with pytest.raises(ValueError, match=fragment):
        resolve_config(None, None, sets)


@pytest.mark.parametrize("sets, fragment", [
    ([], "launch with torchrun --nproc-per-node 2"),
    (["parallel.world_size=2", "rollout.in_flight_updates=true"], "max_staleness >= 1"),
    (["parallel.world_size=2", "eval.every=5"], "maspo eval"),
    (["parallel.world_size=2", "train.offload_optimizer=true"], "turn it off"),
])
def test_cross_section_checks(sets, fragment):
    base = ["rollout.placement=disaggregated", "rollout.engine_ranks=1"]
    with pytest.raises(ValueError, match=fragment):  # resolve_config runs check_combinations once
        resolve_config(None, None, [*base, *sets])
    cfg = resolve_config(None, None, [*base, "parallel.world_size=2"])
    check_combinations(cfg)  # the valid one passes


def test_engine_tp_is_the_vllm_tp_only_for_vllm():
    assert RolloutConfig(engine="vllm", vllm_tp=4).engine_tp == 4
    assert RolloutConfig(vllm_tp=4).engine_tp == 1

"""The disaggregated placement in the planner: pools from ``PoolLayout``, the colocated phase models on each
pool, the broadcast, the overlap (max for k >= 1, sum for k = 0), memory without a shared GPU, the split
scan against colocated, and the CLI."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_maspo.cli.main import main
from megatron_maspo.launch.plan import Assumptions, arch_of, estimate, layout_of
from megatron_maspo.launch.plan import estimator as P
from megatron_maspo.launch.plan.disagg import (
    POOL_CHANGES,
    PoolStepTime,
    broadcast_seconds,
    estimate_disaggregated,
    export_seconds,
    max_engine_fraction,
)
from megatron_maspo.launch.plan.split import (
    colocated_config,
    compare_placements,
    disaggregated_config,
    split_candidates,
)
from megatron_maspo.launch.plan.types import gpu_assumptions
from megatron_maspo.launch.plan.verdict import memory_verdicts
from megatron_maspo.recipes.registry import load_recipe

HW = Assumptions()


def _cfg(recipe="r1_distill_qwen_7b_maspo", world=32):
    cfg = load_recipe(recipe)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, world_size=world))


def _split(r=16, k=1, frac=0.9, recipe="r1_distill_qwen_7b_maspo"):
    cfg = disaggregated_config(_cfg(recipe), r, staleness=k, engine_fraction=frac)
    return cfg, estimate_disaggregated(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8, hw=HW)


def test_step_is_the_max_of_the_pools_with_staleness_and_their_sum_without():
    t = PoolStepTime(generation=100, grading=5, apply=5, old_logprob=20, update=60, export=1, broadcast=2,
                     staleness=1)
    assert t.engine_side == 110 and t.trainer_side == 83
    assert t.total == 110 and t.bound == "rollout"
    assert t.total_at(0) == 193 and dataclasses.replace(t, staleness=0).total == 193
    assert dataclasses.replace(t, generation=10).bound == "training"


def test_broadcast_is_one_sender_at_the_slowest_link_plus_the_host_copy_in_series():
    w = 40e9  # bytes
    assert broadcast_seconds(w, 0, link_gb_s=40, host_gb_s=None, latency_s=0) == pytest.approx(1.0)
    assert broadcast_seconds(w, 0, link_gb_s=40, host_gb_s=20, latency_s=0) == pytest.approx(3.0)
    assert broadcast_seconds(w, 10, link_gb_s=40, host_gb_s=None, latency_s=1e-3) == pytest.approx(1.03)
    # a pipeline stage on another node sends its share of the layers over the fabric to the sender
    on_node = export_seconds(w, pp=2, trainer_world=8, gpus_per_node=8, hw=HW)
    off_node = export_seconds(w, pp=2, trainer_world=16, gpus_per_node=8, hw=HW)
    assert on_node == pytest.approx(w / 150e9) and off_node == pytest.approx(on_node + w / 2 / 40e9)


def test_pools_come_from_the_runtime_layout_and_each_phase_from_the_colocated_models():
    cfg, plan = _split(16)
    assert plan.fits, plan.reasons
    assert plan.pools.trainer_world == 16 and plan.pools.num_engines == 16 and plan.dp == 8
    spec, lay = arch_of(cfg), layout_of(cfg)
    reasons: list[str] = []
    sh = P._shape(cfg, spec, lay, 8, HW, reasons)
    old_lp, update = P._trainer_seconds(cfg, spec, lay, sh, 16, HW, 8)
    assert (plan.time.old_logprob, plan.time.update) == pytest.approx((old_lp, update))
    # the training pool's forward/backward is the colocated one on half the GPUs: twice as long
    col = estimate(colocated_config(cfg), spec, lay, nodes=4, gpus_per_node=8, hw=HW)
    assert plan.time.update == pytest.approx(2 * col.time.update, rel=0.02)
    # engines on other nodes than trainer rank 0: InfiniBand; vLLM stages the sync in host memory
    w = 2 * spec.num_parameters()
    assert plan.link == "InfiniBand" and plan.time.broadcast == pytest.approx(w / 40e9 + w / 20e9, rel=3e-3)
    assert plan.time.apply == pytest.approx(HW.sync_fixed_s + w / 10e9 + w / 20e9)


def test_memory_no_engine_on_a_training_gpu_and_the_engine_gets_its_own_gpu():
    cfg, plan = _split(16, frac=0.9)
    m, e = plan.memory, plan.engine
    assert m.engine == 0 and not m.offloaded
    assert m.peak == pytest.approx(max(m.train_peak, m.weights + m.reference + m.grads + m.optimizer + m.reserve
                                       + cfg.rollout.bucket_mb / 1024))
    assert e.share == pytest.approx(0.9 * 80) and e.staged == 0 and e.host == pytest.approx(2 * 7.62e9 / 2**30, rel=0.01)
    assert e.peak == pytest.approx(72 + 1.5 + 3)
    assert plan.engine_fraction_max == max_engine_fraction(80, buckets_gb=1.5, reserve_gb=3) == 0.94
    # more engine share than its GPU holds: refused on the engine GPU, and the verdict is the share that fits
    _, over = _split(16, frac=0.97)
    assert any("per engine GPU" in r for r in over.reasons)
    verdicts = memory_verdicts(disaggregated_config(_cfg(), 16, staleness=1, engine_fraction=0.97), arch_of(cfg),
                               over, nodes=4, gpus_per_node=8, hw=HW, estimator=estimate_disaggregated,
                               changes=POOL_CHANGES)
    assert verdicts and verdicts[0].change == "a smaller engine share"
    assert "rollout.vllm_gpu_memory_utilization=0.94" in verdicts[0].overrides
    assert "offload" not in {n for n, _ in POOL_CHANGES}


def test_builtin_engine_stages_the_sync_on_its_gpu():
    cfg = _cfg()
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="builtin"))
    cfg = disaggregated_config(cfg, 16, staleness=1)
    plan = estimate_disaggregated(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8, hw=HW)
    e = plan.engine
    assert e.host == 0 and e.staged == pytest.approx(e.weights) and plan.engine_fraction_max is None


def test_refused_splits_name_the_runtime_reason():
    assert split_candidates(8, 2) == [2, 4, 6]
    _, odd = _split(15, frac=0.9)  # 17 training ranks for tp = 2
    assert odd.time is None and "not a multiple of tp*pp*cp=2" in odd.reasons[0]
    cfg, moe = _split(8, recipe="qwen3_30b_a3b_maspo")  # dp 12 of the training pool is not a multiple of ep 8
    assert any("not divisible by ep=8" in r for r in moe.reasons)
    with pytest.raises(ValueError, match="multiple of the engine TP"):
        disaggregated_config(_cfg("qwen3_30b_a3b_maspo"), 3, staleness=1)


def test_config_for_a_split_passes_the_configs_own_checks():
    from megatron_maspo.config import check_combinations

    cfg = disaggregated_config(_cfg(), 16, staleness=1, engine_fraction=0.9)
    check_combinations(cfg)  # k = 1 got a rollout correction, offload is off
    assert cfg.loss.tis_cap == 2.0 and cfg.rollout.engine_ranks == 16


def test_comparison_finds_the_best_split_for_both_recipes():
    for recipe in ("r1_distill_qwen_7b_maspo", "qwen3_30b_a3b_maspo"):
        cfg = _cfg(recipe)
        cmp = compare_placements(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8, hw=HW)
        best, sets = cmp.best
        assert cmp.staleness == 1 and best.fits
        assert best.time.total == min(p.time.total for p, _ in cmp.splits if p.fits)
        assert cmp.speedup == pytest.approx(cmp.colocated.time.total / best.time.total)
        assert "rollout.placement=disaggregated" in sets and f"rollout.engine_ranks={best.engine_ranks}" in sets
        # at k = 0 no split beats colocated: every phase runs on fewer GPUs, in turn
        assert all(p.time.total_at(0) > cmp.colocated.time.total for p, _ in cmp.splits if p.fits)
    # k = 0 asked for: the best split is the sum, slower than colocated
    cfg = _cfg()
    cmp0 = compare_placements(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8, hw=HW, staleness=0)
    assert cmp0.speedup < 1


def test_cli_prints_the_comparison_and_plans_a_disaggregated_config(capsys):
    assert main(["plan", "r1_distill_qwen_7b_maspo", "--nodes", "4", "--splits"]) == 0
    out = capsys.readouterr().out
    assert "placement: colocated step" in out and "best disaggregated split at k=1" in out
    assert "step k=1" in out and "other split(s) refused by the pools' layout" in out
    sets = ["--set", "rollout.placement=disaggregated", "--set", "rollout.engine_ranks=16", "--set",
            "rollout.max_staleness=1", "--set", "loss.tis_cap=2.0"]
    assert main(["plan", "r1_distill_qwen_7b_maspo", "--nodes", "4", *sets]) == 0
    out = capsys.readouterr().out
    assert "training pool 16 GPUs" in out and "rollout pool 16 GPUs" in out and "InfiniBand 40 GB/s" in out
    assert "no engine, nothing offloaded" in out and "at k=1 (max of the pools" in out
    assert main(["plan", "r1_distill_qwen_7b_maspo", "--nodes", "4", *sets, "--internode-gb-s", "0"]) == 2


@pytest.mark.parametrize("recipe,nodes", [("glm45_air_maspo", 16), ("deepseek_v3_maspo", 64),
                                           ("qwen3_235b_a22b_maspo", 32)])
def test_moe_recipes_colocated_and_one_step_off(capsys, recipe, nodes):
    """Each large-MoE recipe at its cluster size: ``maspo plan --splits`` prints the colocated step and the
    best k = 1 split with its generation / training split; a split's k = 1 step is the slower pool's time
    (the overlap hides the faster pool, never more) and never longer than the same split run serially
    (k = 0); in-flight updates (the straggler tail overlapping the next batch) never lengthen it."""
    cfg = _cfg(recipe, world=nodes * 8)
    hw = gpu_assumptions(cfg.parallel.gpu)
    cmp = compare_placements(cfg, arch_of(cfg), layout_of(cfg), nodes=nodes, gpus_per_node=8, hw=hw)
    assert cmp.colocated.fits and cmp.staleness == 1
    fitting = [p for p, _ in cmp.splits if p.fits]
    assert fitting
    for p in fitting:
        t = p.time
        assert t.total == max(t.engine_side, t.trainer_side) <= t.total_at(0)
        assert t.total_at(0) == pytest.approx(t.engine_side + t.trainer_side)
    best, flight = cmp.best[0].time, cmp.in_flight[0].time
    assert flight.engine_side < best.engine_side and flight.trainer_side == best.trainer_side
    assert flight.total <= best.total
    assert main(["plan", recipe, "--nodes", str(nodes), "--splits"]) == 0
    out = capsys.readouterr().out
    assert "placement: colocated step" in out and "best disaggregated split at k=1" in out
    assert "generation" in out and "update" in out and "in_flight_updates=true" in out

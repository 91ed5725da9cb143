"""The fewest engines a disaggregated rollout pool can run the step with (``disagg.min_pool_engines``): the
slack rule by hand, k = 0 against k >= 1, the bounds, the plan's field and the line ``maspo plan`` and
``maspo check`` print."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_maspo.cli.main import main
from megatron_maspo.launch.plan import Assumptions, arch_of, layout_of
from megatron_maspo.launch.plan.disagg import (
    POOL_SLACK,
    PoolSize,
    PoolStepTime,
    _engine_side_at,
    estimate_disaggregated,
    min_pool_engines,
)
from megatron_maspo.launch.plan.report import format_pool_size
from megatron_maspo.launch.plan.split import disaggregated_config
from megatron_maspo.recipes.registry import load_recipe, resolve_config
from megatron_maspo.rollout.fleet import FleetLayout

HW = Assumptions()
SETS = ["--set", "rollout.placement=disaggregated", "--set", "rollout.engine_ranks=16", "--set",
        "rollout.max_staleness=1", "--set", "loss.tis_cap=2.0"]


def _time(generation, *, trainer, apply=0.0, k=1):
    return PoolStepTime(generation=generation, grading=0.0, apply=apply, old_logprob=0.0, update=trainer,
                        export=0.0, broadcast=0.0, staleness=k)


def _sharded(prompts, per_prompt_s):
    """(generation, grading) of the most loaded of e engines: its shard as ``FleetLayout.shard_sizes``."""
    return lambda e: (per_prompt_s * max(FleetLayout(world=e, rollout_tp=1).shard_sizes(prompts)), 0.0)


def test_the_slack_rule_by_hand():
    # 16 prompts at 5 s each over E = 4 engines: 20 s; 3 engines hold 6 (30 s), 2 hold 8 (40 s), 1 all (80 s).
    # apply 2 s, training pool 30 s, k = 1: steps 30, 32, 42, 82 for E' = 4, 3, 2, 1; 10 % of 30 is 33
    side = _sharded(16, 5.0)
    size = min_pool_engines(_time(20.0, trainer=30.0, apply=2.0), 4, side)
    assert (size.min_engines, size.step_s, size.min_step_s) == (3, 30.0, 32.0)
    assert (size.fewer_step_s, size.fewer_bound) == (42.0, "rollout") and size.slack == POOL_SLACK == 0.10
    # no slack: the 32 s of 3 engines is too long; half: 2 engines (42 <= 45), and 1 engine (82) is not
    assert min_pool_engines(_time(20.0, trainer=30.0, apply=2.0), 4, side, slack=0.0).min_engines == 4
    half = min_pool_engines(_time(20.0, trainer=30.0, apply=2.0), 4, side, slack=0.5)
    assert (half.min_engines, half.min_step_s, half.fewer_step_s) == (2, 42.0, 82.0)


def test_one_engine_is_enough_when_the_training_pool_dominates_at_k1():
    size = min_pool_engines(_time(10.0, trainer=200.0, apply=1.0), 8, lambda e: (80.0 / e, 0.0))
    assert (size.min_engines, size.min_step_s, size.fewer_step_s) == (1, 200.0, None)
    assert format_pool_size(size) == "rollout pool: 8 engines; minimum 1 (step 200.0 s, within 10% of 200.0 s)"


def test_every_engine_counts_at_k0_when_generation_is_most_of_the_step():
    # 400 / e s of generation, 10 s of training: 110 s with 4 engines, 143.3 s with 3 (> 121)
    size = min_pool_engines(_time(100.0, trainer=10.0, k=0), 4, lambda e: (400.0 / e, 0.0))
    assert size.min_engines == 4 and size.fewer_step_s == pytest.approx(400 / 3 + 10)
    # the same pools one step off: the engine side is the step, 4 -> 3 engines is +33 %, still too much
    assert min_pool_engines(_time(100.0, trainer=10.0, k=1), 4, lambda e: (400.0 / e, 0.0)).min_engines == 4
    # at k = 1 the engines are free while their side stays under the training pool's (+ 10 %): with 120 s
    # of training 3 engines take 133.3 s > 132; with 140 s they fit (<= 154), 2 engines (200 s) do not
    assert min_pool_engines(_time(100.0, trainer=120.0, k=1), 4, lambda e: (400.0 / e, 0.0)).min_engines == 4
    assert min_pool_engines(_time(100.0, trainer=140.0, k=1), 4, lambda e: (400.0 / e, 0.0)).min_engines == 3


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("engines,prompts,per_prompt,trainer", [(1, 8, 3.0, 5.0), (4, 64, 2.0, 40.0),
                                                                  (8, 512, 0.5, 120.0), (16, 100, 1.0, 1.0),
                                                                  (32, 512, 0.4, 600.0)])
def test_the_minimum_is_between_one_and_e_and_is_the_first_within_the_slack(k, engines, prompts, per_prompt,
                                                                            trainer):
    side = _sharded(prompts, per_prompt)
    t = _time(side(engines)[0], trainer=trainer, apply=1.0, k=k)
    last = engines
    for slack in (0.0, 0.05, POOL_SLACK, 0.5, 10.0):
        size = min_pool_engines(t, engines, side, slack=slack)
        assert 1 <= size.min_engines <= engines and size.min_engines <= last  # more slack: never more engines
        last = size.min_engines
        assert size.step_s == t.total and size.min_step_s <= size.step_s * (1 + slack) + 1e-9
        if size.min_engines > 1:
            assert size.fewer_step_s > size.step_s * (1 + slack)
        step = [dataclasses.replace(t, generation=side(e)[0]).total_at(k) for e in range(1, engines + 1)]
        assert all(s > size.step_s * (1 + slack) for s in step[:size.min_engines - 1])
    with pytest.raises(ValueError, match="engines must be >= 1"):
        min_pool_engines(t, 0, side)


def _plan(*, frac=0.9, k=1):
    cfg = load_recipe("r1_distill_qwen_7b_maspo")
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, world_size=32))
    cfg = disaggregated_config(cfg, 16, staleness=k, engine_fraction=frac)
    return cfg, estimate_disaggregated(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8, hw=HW)


def test_the_plan_carries_it_when_it_fits_and_the_engine_side_is_the_pools():
    cfg, plan = _plan()
    assert plan.fits and isinstance(plan.pool_size, PoolSize)
    assert plan.pool_size.engines == plan.pools.num_engines == 16
    assert 1 <= plan.min_engines <= 16 and plan.min_engines_step_s == plan.pool_size.min_step_s
    assert plan.pool_size.step_s == plan.time.total
    # recomputed at E engines, the engine side is the plan's own (same engine, same shards)
    from megatron_maspo.launch.plan import estimator as P

    spec, lay = arch_of(cfg), layout_of(cfg)
    sh = P._shape(cfg, spec, lay, plan.dp, HW, [])
    _, engine_w, kv_pool = P._engine_bytes(cfg, spec, lay, sh, 16, HW)
    at = _engine_side_at(cfg, spec, lay, sh, engine_w, kv_pool, HW, 8, lay.vllm_tp)
    assert at(16) == pytest.approx((plan.time.generation, plan.time.grading))
    # fewer engines, more prompts each: never faster
    assert all(at(e)[0] >= at(e + 1)[0] for e in range(1, 16))
    # a refused plan has none
    _, refused = _plan(frac=0.99)
    assert not refused.fits and refused.pool_size is None and refused.min_engines == 0


def test_maspo_plan_prints_the_line_for_a_disaggregated_recipe(capsys):
    assert main(["plan", "r1_distill_qwen_7b_maspo", "--nodes", "4", *SETS]) == 0
    out = capsys.readouterr().out
    line = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("rollout pool: "))
    assert line.startswith("rollout pool: 16 engines; minimum ") and "-bound)" in line
    # and nothing else in the report moved: the step line still comes before it, the pools after it
    lines = [ln.strip() for ln in out.splitlines()]
    at = lines.index(line)
    assert lines[at - 1].startswith("step s: ") and lines[at + 1].startswith("pools (as the job builds them)")


def test_maspo_check_prints_the_line_after_the_memory_plan():
    from megatron_maspo.check.run import check_config

    cfg = resolve_config("tiny", None, ["rollout.placement=disaggregated", "rollout.max_staleness=1",
                                        "loss.tis_cap=2.0", "parallel.world_size=2", "rollout.engine=vllm",
                                        "rollout.engine_ranks=1"])
    res = check_config(cfg, nodes=1, gpus_per_node=2)
    assert res.ok, res.lines
    assert res.lines[-2].startswith("ok   memory plan")
    assert res.lines[-1].startswith("ok   rollout pool: 1 engine; minimum 1 (step ")

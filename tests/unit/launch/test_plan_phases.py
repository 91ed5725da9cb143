"""The rollout peak in the trainer's phase order, and the memory verdicts that name what makes a layout fit."""

from __future__ import annotations

import pytest

from megatron_maspo.launch.plan import Assumptions, arch_of, estimate, layout_of
from megatron_maspo.launch.plan.memory import (
    ROLLOUT_PHASE_ORDER,
    ROLLOUT_START_TERMS,
    rollout_trace,
)
from megatron_maspo.launch.plan.verdict import CHANGES, memory_verdicts
from megatron_maspo.recipes.registry import load_recipe

TERMS = {"trainer_state": 40.0, "reserve": 3.0, "engine_weights": 15.0, "sync_bucket": 0.5,
         "offloaded_state": 20.0, "offloaded_params": 10.0, "engine_kv": 25.0}


def test_phase_order_is_the_trainers():
    """state offload -> weights wake -> sync -> params offload -> KV wake (the order the trainer runs from the
    update to generation); kept as data so it can be compared with the trainer's own record of its phases."""
    assert [p for p, _ in ROLLOUT_PHASE_ORDER] == ["state_offload", "weights_wake", "sync", "params_offload",
                                                   "kv_wake"]
    assert ROLLOUT_START_TERMS == ("trainer_state", "reserve")


def test_trace_walks_the_phases():
    trace = dict(rollout_trace(TERMS))
    assert trace == pytest.approx({"state_offload": 43.0, "weights_wake": 38.0, "sync": 38.5,
                                   "params_offload": 38.0, "kv_wake": 53.0})


def test_the_order_decides_the_peak():
    """Waking the engine's weights before the grads and optimizer leave (the trainer's order until 2026-12)
    peaks higher: the order is not cosmetic."""
    state, wake, sync, params, kv = ROLLOUT_PHASE_ORDER
    old = (wake, sync, state, params, kv)
    assert max(g for _, g in rollout_trace(TERMS, old)) == pytest.approx(58.5)
    assert max(g for _, g in rollout_trace(TERMS)) == pytest.approx(53.0)  # now at the KV wake


def _plan(**train):
    cfg = load_recipe("r1_distill_qwen_7b_maspo")
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg, estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8)


def test_plan_rollout_peak_is_the_trace_maximum():
    _, plan = _plan(offload_params=True, offload_grads=True, offload_optimizer=True, reference_model=True)
    m = plan.memory
    trace = dict(m.rollout_trace)
    assert m.rollout_peak == pytest.approx(max(trace.values()))
    state = m.weights + m.reference + m.grads + m.optimizer + m.reserve
    early = m.offloaded.get("grads", 0.0) + m.offloaded.get("optimizer", 0.0)
    assert trace["weights_wake"] == pytest.approx(state - early + m.engine_weights)
    assert trace["kv_wake"] == pytest.approx(state - m.host + m.engine)


def test_verdicts_for_a_refused_layout_are_cheapest_first_and_fit():
    cfg, _ = _plan(reference_model=True)
    cfg.rollout.vllm_gpu_memory_utilization = 0.75
    hw = Assumptions()
    plan = estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8, hw=hw)
    assert not plan.fits
    verdicts = memory_verdicts(cfg, arch_of(cfg), plan, nodes=4, gpus_per_node=8, hw=hw)
    assert verdicts and [v.cost_s for v in verdicts] == sorted(v.cost_s for v in verdicts)
    for v in verdicts:
        assert v.plan.fits and v.margin_gb == pytest.approx(hw.gpu_mem_gb - v.plan.memory.peak)
        assert v.cost_s == pytest.approx(v.plan.time.total - plan.time.total)
    off = next(v for v in verdicts if v.change == "offload")
    assert off.cost_s == pytest.approx(off.plan.time.offload) and off.describe().startswith("fits with offload, by ")
    assert {n for n, _ in CHANGES} >= {"offload", "recompute", "a smaller engine share", "pp x 2", "tp x 2"}


def test_no_verdict_for_a_layout_that_fits_or_fails_for_other_reasons():
    cfg, plan = _plan()
    assert plan.fits and memory_verdicts(cfg, arch_of(cfg), plan, nodes=4, gpus_per_node=8, hw=Assumptions()) == []

"""Planner memory for colocated runs that offload the trainer during generation: the rollout peak drops by
what is offloaded, the host memory it needs is reported, the train peak is unchanged. (The per-category
bytes themselves are checked against train/actor/offload.py's measured bytes in tests/distributed/
test_plan_memory.py.)"""

from __future__ import annotations

import pytest

from megatron_maspo.cli.main import main
from megatron_maspo.launch.plan import GIB, Assumptions, arch_of, estimate, layout_of
from megatron_maspo.launch.plan.memory import category_bytes, offloaded_bytes
from megatron_maspo.recipes.registry import load_recipe
from megatron_maspo.train.actor.offload import CATEGORIES


def _plan(**train):
    cfg = load_recipe("r1_distill_qwen_7b_maspo")
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8)


def test_categories_are_the_offloaders():
    state = category_bytes(weights=2.0, reference=1.0, grads=4.0, optimizer=8.0)
    assert tuple(state) == CATEGORIES
    assert offloaded_bytes(state, params=True, grads=False, optimizer=True) == \
        {"params": 3.0, "grads": 0.0, "optimizer": 8.0}


@pytest.mark.parametrize("flags,cats", [
    ({"offload_params": True}, ("params",)),
    ({"offload_grads": True, "offload_optimizer": True}, ("grads", "optimizer")),
    ({"offload_params": True, "offload_grads": True, "offload_optimizer": True}, CATEGORIES),
])
def test_rollout_peak_drops_by_what_is_offloaded(flags, cats):
    base, off = _plan(reference_model=True), _plan(reference_model=True, **flags)
    m, m0 = off.memory, base.memory
    held = {"params": m0.weights + m0.reference, "grads": m0.grads, "optimizer": m0.optimizer}
    assert set(m.offloaded) == set(cats)
    assert m.offloaded == pytest.approx({c: held[c] for c in cats})
    assert m.host == pytest.approx(sum(held[c] for c in cats))
    # The offloaded grads and optimizer leave before the engine's weights wake (and the sync runs), the
    # offloaded params after it, then the KV cache wakes: the rollout peak is the highest of those moments
    # (launch/plan/memory.py::ROLLOUT_PHASE_ORDER).
    state = m.weights + m.reference + m.grads + m.optimizer + m.reserve
    early = m.offloaded.get("grads", 0.0) + m.offloaded.get("optimizer", 0.0)
    assert m.rollout_peak == pytest.approx(max(state, state - early + m.engine_weights + m.sync_bucket,
                                               m0.rollout_peak - m.host))
    assert m.train_peak == pytest.approx(m0.train_peak)  # everything is back for the update
    assert m0.offloaded == {} and m0.host == 0.0
    # moving it out before generation and back before the update costs host-link time
    assert off.time.offload == pytest.approx(2 * m.host * GIB / (Assumptions().host_gb_s * 1e9))
    assert off.time.total == pytest.approx(base.time.total + off.time.offload)


def test_reference_model_weights_are_resident_and_count():
    without, with_ref = _plan(), _plan(reference_model=True)
    assert without.memory.reference == 0.0
    assert with_ref.memory.reference == pytest.approx(with_ref.memory.weights)
    assert with_ref.memory.train_peak == pytest.approx(without.memory.train_peak + with_ref.memory.weights)


def test_offload_lets_a_colocated_run_fit_that_the_engine_share_refuses():
    """r1_distill_qwen_7b on 4 x 8 GPUs (its TP 2) with a 0.75 engine share: the rollout peak is over 80 GiB
    with the trainer's state resident, and fits once it is offloaded."""
    def plan(**flags):
        cfg = load_recipe("r1_distill_qwen_7b_maspo")
        cfg.rollout.vllm_gpu_memory_utilization = 0.75
        for k, v in flags.items():
            setattr(cfg.train, k, v)
        return estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8)
    resident = plan()
    assert not resident.fits and resident.memory.rollout_peak > 80
    offloaded = plan(offload_params=True, offload_grads=True, offload_optimizer=True)
    assert offloaded.fits and offloaded.memory.rollout_peak < 80, offloaded.reasons


def test_cli_reports_host_memory(capsys):
    assert main(["plan", "r1_distill_qwen_7b_maspo", "--nodes", "4", "--set", "train.offload_optimizer=true",
                 "--set", "train.offload_grads=true"]) == 0
    out = capsys.readouterr().out
    plan = _plan(offload_optimizer=True, offload_grads=True)
    m = plan.memory
    assert (f"offloaded during generation GiB/GPU: grads {m.offloaded['grads']:.1f}  optimizer "
            f"{m.offloaded['optimizer']:.1f}; pinned host memory {m.host:.1f} GiB per GPU "
            f"({m.host * 8:.0f} GiB per node)") in out
    assert f"offload {plan.time.offload:.1f}" in out


def test_planner_phase_order_is_the_trainers():
    """The planner's rollout order (launch/plan/memory.py::ROLLOUT_PHASE_ORDER) is the trainer's own
    (train/actor/offload.py::STEP_PHASES, which the loop's Colocation runs): from the end of the update,
    the grads and optimizer go to the host, the engine's weights wake, the sync runs, the parameters go to the
    host, then the KV cache wakes."""
    from megatron_maspo.launch.plan.memory import ROLLOUT_PHASE_ORDER
    from megatron_maspo.train.actor.offload import phase_order

    trainer = phase_order()
    start = trainer.index("offload_state")
    after_update = trainer[start:] + trainer[:start]  # the step is a cycle: wake_weights follows train
    planner_to_trainer = {"state_offload": "offload_state", "weights_wake": "wake_weights", "sync": "sync",
                          "params_offload": "offload_trainer", "kv_wake": "wake_kv_cache"}
    planned = [planner_to_trainer[name] for name, _ in ROLLOUT_PHASE_ORDER]
    assert [p for p in after_update if p in planned] == planned, (after_update, planned)

"""Capacity planner (pure maths): per-GPU memory and a step-time split for a recipe on a cluster.

``maspo plan`` and ``maspo check`` read it; nothing here imports ``train/`` (the offload categories and the
layout refusals it shares with the trainer live under ``parallel/``). One module per part of the model:

    estimator     the colocated plan: ``estimate`` (memory, step time, refusals), the layout search
                  (``suggest``) and the config readers every plan shares (``arch_of``, ``layout_of``);
                  its docstring holds the formulas
    types         the data: ``Assumptions`` (hardware, efficiencies), ``Layout``, ``Memory``, ``Plan``
    model         per-architecture figures: parameters per GPU, activation, attention and KV bytes
    memory        the offload categories' bytes and the rollout's phase order
    rollout       generation time per engine (decode steps, waves, the straggler tail)
    cp            context parallelism's ring exchange and the trainer's CP refusals
    dispatch      a single controller's data shipping (``--controller-gb-s``)
    disagg        the disaggregated placement: one plan per pool (``estimate_disaggregated``)
    split         colocated vs every disaggregated split of the same GPUs
    verdict       what makes a plan refused on memory fit, and its cost
    report        the text ``maspo plan`` prints
    calibration   the planner against published RL runs (docs/planner-calibration.md)

The names below are the planner's public entry points, importable from ``megatron_maspo.launch.plan`` as
before it was a package. ``dispatch`` and ``calibration`` are not imported here: both run as scripts
(``python -m megatron_maspo.launch.plan.calibration``), and a module the package already imported would
run twice.
"""

from megatron_maspo.launch.plan.disagg import POOL_CHANGES, PoolPlan, estimate_disaggregated
from megatron_maspo.launch.plan.estimator import (
    apply_layout,
    arch_of,
    estimate,
    fleet_of,
    layout_of,
    seq_second_moment,
    suggest,
)
from megatron_maspo.launch.plan.model import (
    activation_bytes,
    active_params,
    dense_attention_bytes,
    expert_active_params,
    kv_bytes_per_token,
    local_params,
)
from megatron_maspo.launch.plan.report import format_plan
from megatron_maspo.launch.plan.types import GIB, Assumptions, Layout, Memory, Plan, StepTime

__all__ = ["GIB", "POOL_CHANGES", "Assumptions", "Layout", "Memory", "Plan", "PoolPlan", "StepTime",
           "active_params", "activation_bytes", "apply_layout", "arch_of", "dense_attention_bytes", "estimate",
           "estimate_disaggregated", "expert_active_params", "fleet_of", "format_plan", "kv_bytes_per_token",
           "layout_of", "local_params", "seq_second_moment", "suggest"]

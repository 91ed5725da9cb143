"""The planner with engines larger than a node (issue 56): the engine TP may take whole nodes, the TP
all-reduces and the sync's relay then cross the inter-node network, and the published DeepSeek-V3 and
Qwen3-235B-A22B layouts that use such engines are admitted."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_maspo.launch.plan.estimator import _engine_tp_reasons, arch_of, estimate, layout_of
from megatron_maspo.launch.plan.published_layouts import RUNS, plan_run, table
from megatron_maspo.launch.plan.rollout import cross_node_allreduce, cross_node_relay_seconds
from megatron_maspo.launch.plan.types import Layout
from megatron_maspo.recipes.registry import load_recipe

DOC = Path(__file__).resolve().parents[3] / "docs" / "performance-model.md"


def test_engine_tp_takes_whole_nodes_or_divides_one():
    assert _engine_tp_reasons(Layout(tp=1, pp=1, vllm_tp=16), 32, 8) == []
    assert _engine_tp_reasons(Layout(tp=1, pp=1, vllm_tp=4), 36, 6) == [
        "rollout.vllm_tp=4 must divide the 6 GPUs of a node, or be a multiple of them (an engine larger than "
        "a node takes whole nodes)"]
    assert "must divide the engines' GPUs (32)" in _engine_tp_reasons(Layout(tp=1, pp=1, vllm_tp=12), 32, 8)[0]


def test_cross_node_allreduce_costs_latency_per_step_and_bytes_per_token():
    args = dict(hidden=7168, layers=61, gpus_per_node=8, latency_us=20.0, internode_gb_s=40.0)
    assert cross_node_allreduce(vllm_tp=8, **args) == (0.0, 0.0)
    step2, tok2 = cross_node_allreduce(vllm_tp=16, **args)
    step4, tok4 = cross_node_allreduce(vllm_tp=32, **args)
    # 2 all-reduces per layer, a reduce-scatter + all-gather ring of 2k hops each
    assert step2 == pytest.approx(2 * 61 * 4 * 20e-6) and step4 == pytest.approx(2 * step2)
    # the ring's 2(k-1)/k of the message, spread over the node's 8 NICs
    assert tok2 == pytest.approx(2 * 61 * 7168 * 2 * 1.0 / (8 * 40e9)) and tok4 == pytest.approx(1.5 * tok2)
    assert cross_node_relay_seconds(80e9, vllm_tp=16, gpus_per_node=8, internode_gb_s=40.0) == pytest.approx(2.0)
    assert cross_node_relay_seconds(80e9, vllm_tp=8, gpus_per_node=8, internode_gb_s=40.0) == 0.0


def test_a_spanning_engine_is_slower_per_token_than_the_same_fleet_inside_nodes():
    cfg = load_recipe("qwen3_30b_a3b_maspo")
    lay = layout_of(cfg)
    inside = estimate(cfg, arch_of(cfg), dataclasses.replace(lay, vllm_tp=8), nodes=4, gpus_per_node=8)
    across = estimate(cfg, arch_of(cfg), dataclasses.replace(lay, vllm_tp=16), nodes=4, gpus_per_node=8)
    assert inside.time and across.time and not any("vllm_tp" in r for r in across.reasons)
    assert across.fleet.num_engines == 2 and across.time.sync > inside.time.sync


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_published_layouts_fit(run):
    plan = plan_run(run)
    assert plan.fits, plan.reasons


def test_docs_table_is_what_the_planner_prints_now():
    assert table() in DOC.read_text()
